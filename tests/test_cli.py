"""`python -m hydra_kernels.generate` on the embedded model: the drafter it picks by default (default.json's
batch_1 kind where it has one, else its default kind), plain decoding, a drafter directory, and a refused
combination of flags."""
import pytest

from hydra_kernels import cli
from hydra_kernels.drafters.registry import default_kind


def run(capsys, *argv):
    cli.main(["--prompt", "Name three primary colours.", "--max-new-tokens", "12", *argv])
    return capsys.readouterr().out


def test_default_drafter_is_the_batch_1_kind(capsys):
    out = run(capsys)
    assert f"| {default_kind(batch_1=True)} drafter |" in out and "tokens/step" in out


def test_budget_auto_takes_the_default_kind_which_has_a_table(capsys):
    """--budget auto asks for a searched table: the default kind has one (a composed batch-1 kind may not)."""
    assert f"| {default_kind()} drafter |" in run(capsys, "--budget", "auto")


def test_no_draft_and_a_drafter_directory(capsys):
    from hydra_kernels.drafters import shipped_drafters

    assert "| no drafter |" in run(capsys, "--no-draft")
    assert "| medusa drafter |" in run(capsys, "--drafter", str(shipped_drafters()["medusa"]))


def test_tree_without_a_drafter_is_refused():
    with pytest.raises(SystemExit, match="need a drafter"):
        cli.main(["--prompt", "x", "--no-draft", "--tree", "chain-2"])

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


def test_tree_without_a_drafter_is_refused(capsys):  # argparse's way: exit 2, the option named (test_cli_errors.py)
    with pytest.raises(SystemExit) as err:
        cli.main(["--prompt", "x", "--no-draft", "--tree", "chain-2"])
    assert err.value.code == 2 and "argument --tree: needs a drafter" in capsys.readouterr().err


def test_tree_deeper_than_the_drafters_heads_is_refused_before_any_token(capsys):
    from hydra_kernels.drafters import shipped_drafters

    with pytest.raises(SystemExit) as err:
        cli.main(["--prompt", "x", "--drafter", str(shipped_drafters()["hydra"]), "--tree", "chain-9"])
    out = capsys.readouterr()
    assert err.value.code == 2 and out.out == ""
    assert "error: argument --tree: the tree is 9 deep but the drafter has 4 heads" in out.err

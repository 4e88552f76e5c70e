"""The per-step draft budget (hydra_kernels/budget.py): tables and their lookup, subtrees, plain steps
(skip_step) and smaller trees (set_budget) for every drafter family. A run whose budget changes from step
to step (plain steps, subtrees, the full tree) still emits exactly plain greedy's tokens; a drafter that
catches up in propose() (EAGLE, Amphista, Hydra++'s prefix layer) drafts after plain steps exactly what
it drafts after the same committed tokens without them; bad budgets are refused before any work."""
from __future__ import annotations

import copy

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.budget import BudgetTable, StepBudget, load_tables, tree_key, whole_tree_budget
from hydra_kernels.generate import generate
from test_llama_vs_transformers import make_hf

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1], [5, 5, 5, 5, 5, 5]]


@pytest.fixture(scope="module")
def model():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))


def randomised(d, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 0.2) + (1.0 if "norm" in name else 0.0))
    return d


FAMILIES = {  # name: (new_drafter options, the tree generate() gets)
    "medusa": (dict(kind="medusa", num_heads=3), hk.tree.default_tree(10, depth=3)),
    "hydra": (dict(kind="hydra", num_heads=3), hk.tree.default_tree(10, depth=3)),
    "hydra++": (dict(kind="hydra++", num_heads=2), hk.tree.default_tree(6, depth=2)),
    "eagle-dynamic": (dict(kind="eagle"), dict(total_tokens=8, depth=3, top_k=3)),
    "eagle-static": (dict(kind="eagle"), hk.tree.default_tree(7, depth=3)),
    "amphista": (dict(kind="amphista", num_heads=3), hk.tree.default_tree(8, depth=3)),
    "mlp_speculator": (dict(kind="mlp_speculator", n_predict=2), None),
    "ngram": (dict(kind="ngram"), None),
    "lookahead": (dict(kind="lookahead"), None),
    "combined": (dict(kind="combined"), hk.tree.default_tree(6, depth=3)),  # n-gram + Hydra heads
}


def make(model, name):
    opts, tree = FAMILIES[name]
    if name == "combined":
        heads = randomised(hk.new_drafter(model, kind="hydra", num_heads=3), seed=len(name))
        return hk.new_drafter(model, kind="combined", drafters=[hk.new_drafter(model, kind="ngram"), heads]), tree
    d = hk.new_drafter(model, **opts)
    if name not in ("ngram", "lookahead"):
        randomised(d, seed=len(name))
    return d, tree


def varying_table(drafter, tree, model):
    """A table whose budget changes with the context at every position: a plain step, the full tree and a
    subtree (where the drafter offers one) in turn."""
    bound = drafter.resolve_tree(tree, "cpu")
    levels = drafter.budget_levels(bound)
    contexts = list(range(3, 41))
    cycle = (1, levels[-1], levels[len(levels) // 2])
    nodes = [cycle[i % 3] for i in range(len(contexts))]
    return BudgetTable(device="cpu", tree=tree_key(bound), full=bound.num_nodes, batch_sizes=[1],
                       contexts=contexts, nodes=[nodes])


def test_table_lookup_save_load_and_corrupt_file(tmp_path):
    t = BudgetTable(device="cpu", tree="[[0]]", full=2, batch_sizes=[1, 4, 16], contexts=[128, 2048],
                    nodes=[[2, 2], [2, 1], [1, 1]])
    assert t.nodes_for(1, 100) == 2 and t.nodes_for(3, 100) == 2 and t.nodes_for(4, 3000) == 1
    assert t.nodes_for(2, 100) == 2  # log-nearest: 2 is as near 1 as 4, ties go to the larger batch (4)
    assert t.nodes_for(64, 10) == 1 and t.nodes_for(1, 10**6) == 2
    t.save(tmp_path)
    assert load_tables(tmp_path)["cpu"] == t
    (tmp_path / "budget_cpu.json").write_text('{"device": "cpu", "tree"')
    with pytest.raises(ValueError, match="budget_cpu.json is not a budget table"):
        load_tables(tmp_path)
    for bad in (dict(nodes=[[2, 2]]), dict(nodes=[[3, 2], [2, 1], [1, 1]]), dict(batch_sizes=[4, 1, 16])):
        with pytest.raises(ValueError, match="budget table"):
            BudgetTable(**{**t.__dict__, **bad})


def test_subtrees_are_nested_trees_of_the_best_prior_nodes():
    tree = hk.tree.default_tree(20, depth=4)
    prev = set()
    for n in range(1, 21):
        sub = tree.subtree(n)
        assert sub.num_nodes == n and set(sub.choices) >= prev and set(sub.choices) <= set(tree.choices)
        prev = set(sub.choices)
    assert tree.subtree(20).choices == tree.choices
    assert tree.subtree(3).choices == [(0,), (1,)] or tree.subtree(3).choices == [(0,), (0, 0)]
    with pytest.raises(ValueError, match="has 20"):
        tree.subtree(21)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_varying_budget_is_lossless(model, name):
    """Greedy output with the budget changing every step or two (plain steps included) equals plain
    greedy, batched with ragged prompts, for every family; the steps ran the table's budgets."""
    d, tree = make(model, name)
    d.budget_tables["cpu"] = table = varying_table(d, tree, model)
    plain = generate(model, PROMPTS, max_new_tokens=24, eos_token_id=[])
    out = generate(model, PROMPTS, drafter=d, tree=tree, budget="auto", max_new_tokens=24, eos_token_id=[],
                   backend="reference")
    assert out.sequences == plain.sequences
    assert set(out.step_nodes) >= {1, table.full} and len(out.step_nodes) == out.num_steps
    assert out.num_steps < 24 * 2  # not every step was plain: some drafted
    default = generate(model, PROMPTS, drafter=d, tree=tree, max_new_tokens=24, eos_token_id=[], backend="reference")
    assert default.sequences == plain.sequences
    if tree is not None:  # a pinned tree (tree=...) pins its size unless budget="auto"
        assert set(default.step_nodes) == {table.full} and default.policy_s == 0
    else:  # tree=None: the drafter's own tree, which has a CPU table: the adaptive budget by default (greedy, CPU)
        assert default.policy_s > 0 and 1 in default.step_nodes


def committed_script(model, lens: list[int], accepts: list[list[int]], seed: int):
    """Committed tokens to drive a drafter's protocol by hand: prompts of lengths `lens`, their prefill hidden
    states [B, max(lens), H], and per step (accept lengths n [B], 1 on a plain step; the accepted hidden states
    [B, 4, H] and tokens [B, 4], root first; the root; the next root). -> (prompts, prefill_h, script, last root)."""
    g = torch.Generator().manual_seed(seed)
    B, H = len(lens), model.config.hidden_size
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in lens]
    prefill_h = torch.randn(B, max(lens), H, generator=g)
    script, roots = [], torch.randint(0, 100, (B,), generator=g)
    for n in accepts:
        tok = torch.randint(0, 100, (B, 4), generator=g)
        tok[:, 0] = roots
        nxt = torch.randint(0, 100, (B,), generator=g)
        script.append((torch.tensor(n), torch.randn(B, 4, H, generator=g), tok, roots, nxt))
        roots = nxt
    return prompts, prefill_h, script, roots


@pytest.mark.parametrize("name", ["hydra++", "eagle-dynamic", "eagle-static", "amphista", "eagle-static-flush",
                                  "amphista-flush"])
def test_catching_up_after_plain_steps_drafts_what_proposing_drafts(model, name, monkeypatch):
    """Drive the protocol by hand over the same committed tokens twice: once proposing every step, once
    with plain steps (skip_step) in between. The drafter's state depends only on the committed tokens, so
    the final proposals must be the same. EAGLE's and Amphista's plain steps wait in a backlog run with the
    next draft (two plain steps in a row here), or ("-flush") run at once when the backlog's bound is reached."""
    if name.endswith("-flush"):
        from hydra_kernels.drafters import backlog

        monkeypatch.setattr(backlog, "BACKLOG_ROWS", 2)
        name = name[: -len("-flush")]
    d, tree = make(model, name)
    plan = model.backend_plan("reference")
    bound = d.resolve_tree(tree, "cpu")
    B, lens = 2, torch.tensor([6, 4])
    # a plain first step: the prompts' chunk waits
    prompts, prefill_h, script, roots = committed_script(
        model, lens.tolist(), [[1, 1], [2, 3], [1, 1], [1, 1], [3, 1], [1, 1], [2, 2]], seed=3)

    def run(skip_plain: bool):
        state = d.start(model, B, 64, bound, plan)
        d.after_prefill(state, prefill_h, lens)
        d.observe_tokens(state, [p + [int(r)] for p, r in zip(prompts, script[0][3])])
        seqlens = lens.clone().to(torch.int32)
        for n, hid, tok, root, nxt in script:
            if skip_plain and int(n.max()) == 1:
                d.skip_step(state, root, seqlens)
            else:
                d.propose(state, root, seqlens)
            d.after_step(state, hid, tok, n)
            d.observe_tokens(state, [tok[b, 1:int(n[b])].tolist() + [int(nxt[b])] for b in range(B)])
            seqlens += n.to(torch.int32)
        return d.propose(state, roots, seqlens)

    a, b = run(False), run(True)
    assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "lookahead"]  # lookahead: both hooks do nothing (its
                         + ["eagle-static-flush", "amphista-flush"])  # state is the text and each step's argmax)
def test_after_plain_step_leaves_the_state_after_step_leaves(model, name, monkeypatch):
    """Drafter.after_plain_step(state, hidden [B, H], root [B]) is after_step of a one-token step with every sequence
    active, for every family (the heads and the MLPSpeculator keep `hidden` itself; EAGLE and Amphista hold it in their
    backlog, stacked with the next plain steps' rows; n-gram and lookahead nothing; the rest the default): the same
    committed script driven through both, plain steps (skip_step) in between, drafts the same proposals step by step.
    "-flush": the backlog's bound at 1 position, so held rows are also run by skip_step, not only by a draft."""
    if name.endswith("-flush"):
        from hydra_kernels.drafters import backlog

        monkeypatch.setattr(backlog, "BACKLOG_ROWS", 1)
        name = name[: -len("-flush")]
    d, tree = make(model, name)
    plan = model.backend_plan("reference")
    bound = d.resolve_tree(tree, "cpu")
    B, lens = 3, torch.tensor([7, 4, 5])
    prompts, prefill_h, script, roots = committed_script(
        model, lens.tolist(), [[1, 1, 1], [2, 3, 1], [1, 1, 1], [1, 1, 1], [3, 1, 2], [1, 1, 1]], seed=11)

    def run(hook: bool):
        state = d.start(model, B, 64, bound, plan)
        d.after_prefill(state, prefill_h, lens)
        d.observe_tokens(state, [p + [int(r)] for p, r in zip(prompts, script[0][3])])
        seqlens, drafts = lens.clone().to(torch.int32), []
        for n, hid, tok, root, nxt in script:
            plain = int(n.max()) == 1
            if plain:
                d.skip_step(state, root, seqlens)
            else:
                drafts.append(d.propose(state, root, seqlens).tokens)
            if plain and hook:
                d.after_plain_step(state, hid[:, 0].clone(), root.clone())
            else:
                d.after_step(state, hid, tok, n)
            d.observe_tokens(state, [tok[b, 1:int(n[b])].tolist() + [int(nxt[b])] for b in range(B)])
            seqlens += n.to(torch.int32)
        return drafts + [d.propose(state, roots, seqlens).tokens]

    a, b = run(False), run(True)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_held_plain_rows_make_the_chunks_that_one_position_chunks_make(monkeypatch):
    """drafters/backlog.Backlog: lean plain steps' rows (hold_row, then skip with the step's root), stacked at take(),
    make the chunks that the same steps' one-position pending chunks (rooted, add) make: joined with a drafted step's
    ragged chunk before them and the next draft's after them, and run by skip once BACKLOG_ROWS positions wait."""
    from hydra_kernels.drafters import backlog

    monkeypatch.setattr(backlog, "BACKLOG_ROWS", 5)
    g = torch.Generator().manual_seed(4)
    B, H = 3, 5

    def chunk(n):  # a pending chunk of n[b] valid positions, its last token a placeholder (rooted sets it)
        P = max(n)
        return torch.randn(B, P, H, generator=g), torch.randint(0, 50, (B, P), generator=g), torch.tensor(n)

    drafted, last = chunk([2, 1, 3]), chunk([1, 2, 1])
    rows = [(torch.randn(B, H, generator=g), torch.randint(0, 50, (B,), generator=g)) for _ in range(6)]
    ones = torch.ones(B, dtype=torch.long)
    old, new = backlog.Backlog(), backlog.Backlog()
    got_old, got_new = [], []
    for bl, got in ((old, got_old), (new, got_new)):
        got += bl.skip(*drafted, rows[0][1], first=False)  # a drafted step's chunk, then plain steps
    for h, root in rows[1:]:
        got_old += old.skip(h[:, None], h.new_zeros(B, 1, dtype=torch.long), ones, root, first=False)
        new.hold_row(h)
        got_new += new.skip(None, None, None, root, first=False)
    assert len(got_old) == len(got_new) == 1 and old.rows == new.rows == 3  # 3 + 2 positions run, 3 rows wait
    root = torch.randint(0, 50, (B,), generator=g)
    got_old += old.take(backlog.rooted(*last, root))  # a draft after a drafted step's chunk waits behind held rows
    got_new += new.take_with(*last, root)
    for h, root in rows[:3]:  # a draft after plain steps alone: their rows stacked as one chunk, no join
        got_old += old.skip(h[:, None], h.new_zeros(B, 1, dtype=torch.long), ones, root, first=False)
        new.hold_row(h)
        got_new += new.skip(None, None, None, root, first=False)
    got_old += old.take(backlog.rooted(rows[3][0][:, None], last[1][:, :1], ones, root))
    new.hold_row(rows[3][0])
    got_new += new.take_with(None, None, None, root)
    assert len(got_old) == len(got_new) == 3
    for a, b in zip(got_old, got_new):
        assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))
    new.hold_row(rows[0][0])
    with pytest.raises(RuntimeError, match="never run"):  # a held row not paired before the next hooks: refused
        new.hold_row(rows[1][0])


def test_budget_levels_and_set_budget_draft_the_subtree(model):
    d, tree = make(model, "hydra")
    assert d.budget_levels(tree) == tuple(range(1, 11))
    h, root = torch.randn(2, model.config.hidden_size), torch.tensor([3, 4])
    full = d.draft(model, h, root, tree)
    for n in (2, 4, 7):
        sub = tree.subtree(n)
        idx = [0] + [tree.choices.index(c) + 1 for c in sub.choices]
        assert torch.equal(d.draft(model, h, root, sub), full[:, idx])  # a subtree's tokens are the tree's


def test_ngram_and_lookahead_budgets_cut_the_same_draft(model):
    """n-gram: k-token continuations (k = 1, 2, 4, .., num_tokens), each a prefix of the full draft's;
    lookahead: the window every step plus the g most recent pool n-grams."""
    d = hk.new_drafter(model, kind="ngram", num_tokens=6, num_branches=2)
    bound = d.resolve_tree(None, "cpu")
    assert d.budget_levels(bound) == (1, 3, 5, 9, 13) and bound.num_nodes == 13
    text = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 9, 9, 9, 9, 9, 9, 1, 2, 3]  # suffix [1, 2, 3]: two continuations
    state = d.start(model, 1, 64, bound, None)
    d.observe_tokens(state, [text])
    full = d.draft_lists(state)
    for nodes, k in ((3, 1), (5, 2), (8, 3), (9, 4), (13, 6)):
        d.set_budget(state, nodes)
        assert state.num_tokens == k
        parents, tokens = d.draft_lists(state)
        assert 1 < len(parents[0]) <= nodes
        kept = [i for i, p in enumerate(full[0][0]) if _depth(full[0][0], i) <= k]
        assert tokens[0] == [full[1][0][i] for i in kept]  # the full trie's nodes down to depth k
    la = hk.new_drafter(model, kind="lookahead", window=3, ngram=3, guesses=4)
    lb = la.resolve_tree(None, "cpu")
    assert la.budget_levels(lb) == (1, 9, 11, 13, 15) and lb.num_nodes == 15
    st = la.start(model, 1, 64, lb, None)
    for nodes, g in ((9, 1), (12, 2), (15, 4)):
        la.set_budget(st, nodes)
        assert st.guesses == g


def _depth(parents: list[int], i: int) -> int:
    d = 0
    while parents[i] >= 0:
        i, d = parents[i], d + 1
    return d


def test_mlp_speculator_budgets_keep_its_best_candidates(model):
    """The MLPSpeculator's budgets: c * n_predict + 1 nodes for c = 1, 2, 4, ..., n_candidates; a budget
    keeps the best c suffixes of the same scoring, so its proposal is a prefix of the full one's."""
    d = randomised(hk.new_drafter(model, kind="mlp_speculator", n_predict=3, top_k_tokens_per_head=[3, 2, 2],
                                  n_candidates=6), seed=4)
    bound = d.resolve_tree(None, "cpu")
    assert d.budget_levels(bound) == (1, 4, 7, 13, 19) and bound.num_nodes == 19
    state = d.start(model, 2, 64, bound, model.backend_plan("reference"))
    state.h = torch.randn(2, model.config.hidden_size)
    root = torch.tensor([5, 9])
    full, _ = d.candidates(state.h, root)
    for nodes, c in ((4, 1), (7, 2), (12, 3), (13, 4), (19, None)):
        d.set_budget(state, nodes)
        assert state.n_candidates == c
        prop = d.propose(state, root, torch.tensor([10, 10]))
        assert prop.tokens.shape[1] <= nodes
        cand, _ = d.candidates(state.h, root, state.n_candidates)
        assert torch.equal(cand, full[:, : cand.shape[1]])


def test_bad_budgets_are_refused_before_work(model, tmp_path):
    d, tree = make(model, "hydra")
    with pytest.raises(ValueError, match="budget='auto' needs a budget table"):
        generate(model, PROMPTS, drafter=d, tree=tree, budget="auto", max_new_tokens=4)
    for bad, err in ((0, ValueError), (11, ValueError), ("max", ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(err, match="budget"):
            generate(model, PROMPTS, drafter=d, tree=tree, budget=bad, max_new_tokens=4)
    with pytest.raises(ValueError, match="only used with a drafter"):
        generate(model, PROMPTS, budget=2, max_new_tokens=4)
    # a table searched for another tree is not applied (and "auto" says there is none for this tree)
    d.budget_tables["cpu"] = BudgetTable(device="cpu", tree="[[0]]", full=2, batch_sizes=[1], contexts=[8],
                                         nodes=[[1]])
    out = generate(model, PROMPTS, drafter=d, tree=tree, max_new_tokens=6, eos_token_id=[])
    assert set(out.step_nodes) == {tree.num_nodes}
    with pytest.raises(ValueError, match="budget='auto' needs"):
        generate(model, PROMPTS, drafter=d, tree=tree, budget="auto", max_new_tokens=4)


def test_tables_are_saved_and_used_by_auto_and_make_the_adaptive_budget_the_default(model, tmp_path):
    d, tree = make(model, "hydra")
    d.trees["cpu"] = tree
    d.budget_tables["cpu"] = BudgetTable(device="cpu", tree=tree_key(tree), full=tree.num_nodes, batch_sizes=[1, 4],
                                         contexts=[8], nodes=[[tree.num_nodes], [1]])
    d.save(tmp_path)
    back = hk.load_drafter(tmp_path, model=model)
    assert back.budget_tables == d.budget_tables
    one = generate(model, PROMPTS[:1], drafter=back, budget="auto", max_new_tokens=6, eos_token_id=[])  # the table
    assert set(one.step_nodes) == {tree.num_nodes}
    four = generate(model, PROMPTS[:1] * 4, drafter=back, budget="auto", max_new_tokens=6, eos_token_id=[])
    assert set(four.step_nodes) == {1} and four.sequences == [one.sequences[0]] * 4
    # budget=None with a table for this device and tree (greedy, the CPU): the adaptive budget, the table its choice no
    # more (budget.default_is_adaptive)
    default = generate(model, PROMPTS[:1] * 4, drafter=back, max_new_tokens=6, eos_token_id=[])
    assert default.policy_s > 0 and four.policy_s == one.policy_s == 0 and default.sequences == four.sequences
    pinned = generate(model, PROMPTS[:1] * 4, drafter=back, budget=3, max_new_tokens=6, eos_token_id=[])
    assert set(pinned.step_nodes) == {3} and pinned.sequences == four.sequences
    # whole_tree_budget (what tokens/step figures are measured with): the whole tree every step, table off
    assert whole_tree_budget(back, None, "cpu") == tree.num_nodes and whole_tree_budget(back, tree, "cpu") is None
    whole = generate(model, PROMPTS[:1] * 4, drafter=back, budget=whole_tree_budget(back, None, "cpu"),
                     max_new_tokens=6, eos_token_id=[])
    assert set(whole.step_nodes) == {tree.num_nodes} and whole.sequences == four.sequences


def test_a_run_plain_at_every_step_is_plain_decoding(model, monkeypatch):
    """Where the budget is 1 for every step a request can take (its batch size over its whole context
    range), generate() runs plain decoding: the drafter is never started, the tokens are plain greedy's,
    and every step is recorded as a 1-node budget. A run that crosses into a bucket that drafts does not."""
    d, tree = make(model, "hydra")
    d.trees["cpu"] = tree
    table = BudgetTable(device="cpu", tree=tree_key(tree), full=tree.num_nodes, batch_sizes=[1, 4],
                        contexts=[8, 64], nodes=[[tree.num_nodes, 1], [1, 1]])
    d.budget_tables["cpu"] = table
    budget = StepBudget(tree.num_nodes, table=table)
    assert budget.plain_throughout(4, 3, 200) and budget.plain_throughout(1, 40, 60)
    assert not budget.plain_throughout(1, 8, 40)  # starts in the drafting bucket
    assert not budget.plain_throughout(1, 20, 30)  # nearest bucket of 20 on a log scale: 8 (drafts)
    assert StepBudget(5, pinned=1).plain_throughout(1, 1, 10)
    assert not StepBudget(5).plain_throughout(16, 1, 10)

    def never(*a, **k):
        raise AssertionError("the drafter ran in a run whose every step is plain")

    plain = generate(model, PROMPTS, max_new_tokens=6, eos_token_id=[])
    with monkeypatch.context() as m:
        m.setattr(type(d), "start", never)
        four = generate(model, PROMPTS, drafter=d, budget="auto", max_new_tokens=6, eos_token_id=[])  # batch 3 -> 4
        pinned = generate(model, PROMPTS[:1], drafter=d, budget=1, max_new_tokens=6, eos_token_id=[])
    assert four.sequences == plain.sequences and four.step_nodes == [1] * four.num_steps == [1] * 5  # the first token comes from the prefill
    assert pinned.sequences == plain.sequences[:1] and pinned.step_nodes == [1] * 5
    one = generate(model, PROMPTS[:1], drafter=d, budget="auto", max_new_tokens=6, eos_token_id=[])  # context 8: drafts
    assert one.sequences == plain.sequences[:1] and max(one.step_nodes) == tree.num_nodes


def test_search_makes_a_valid_table_from_its_measurements(model):
    """The search on a tiny model and grid: a table for the drafter's tree, one measured point per bucket,
    each choice the fastest budget when it beats plain decoding by the margin, else a plain step."""
    from hydra_kernels.training.budget_search import candidate_budgets, rechoose, search_budget_table

    assert candidate_budgets(tuple(range(1, 65))) == [2, 4, 8, 16, 32, 64]
    assert candidate_budgets((1, 3)) == [3]
    d, tree = make(model, "hydra")
    prompts = [p * 2 for p in PROMPTS]
    table = search_budget_table(model, d, prompts, tree_arg=tree, batch_sizes=(1, 3), contexts=(16, 40),
                                new_tokens=8, margin=1.03, backend="reference")
    assert table.tree == tree_key(tree) and table.full == tree.num_nodes and len(table.measured["points"]) == 4
    for p in table.measured["points"]:
        spec = {int(k.split("_")[1]): v for k, v in p.items() if k.startswith("nodes_")}
        best = max(spec, key=spec.get)
        assert p["chosen"] == (best if spec[best] >= 1.03 * p["plain_tok_s"] else 1) and p["plain_tok_s"] > 0
    chosen = [[p["chosen"] for p in table.measured["points"] if p["batch"] == B] for B in (1, 3)]
    assert table.nodes[0] == chosen[0] and table.nodes[1] == [min(a, b) for a, b in zip(chosen[1], chosen[0])]
    d.budget_tables["cpu"] = table
    out = generate(model, PROMPTS, drafter=d, tree=tree, budget="auto", max_new_tokens=6, eos_token_id=[])
    assert out.sequences == generate(model, PROMPTS, max_new_tokens=6, eos_token_id=[]).sequences
    # re-choosing from the stored predictions (no timing) with the search's margin gives the same table;
    # an unreachable margin gives plain steps everywhere; a table without predictions is refused
    assert rechoose(table, 1.03) == table
    assert rechoose(copy.deepcopy(table), 1e9).nodes == [[1, 1], [1, 1]]
    with pytest.raises(ValueError, match="no per-point predictions"):
        rechoose(BudgetTable(device="cpu", tree=table.tree, full=table.full, batch_sizes=[1], contexts=[8], nodes=[[1]]))


def test_search_refuses_speculative_steps_timed_faster_than_plain(model, monkeypatch, capsys):
    """A speculative step timed under 0.9x the plain step (the run-differencing failing, as it did for
    Amphista at 8k context) is no measurement: the point runs plain steps, is marked invalid, and says so."""
    from hydra_kernels.training import budget_search

    fake = {None: 0.010}  # plain 10 ms; budgets: 30 ms at batch 1, an impossible 2 ms at batch 3
    monkeypatch.setattr(budget_search, "step_seconds",
                        lambda m, d, t, B, C, nodes, backends, reps=5: fake.get(nodes, 0.030 if B == 1 else 0.002))
    monkeypatch.setattr(budget_search, "tokens_per_step", lambda *a, **k: {n: 4.0 for n in a[4]})
    d, tree = make(model, "hydra")
    table = budget_search.search_budget_table(model, d, PROMPTS, tree_arg=tree, batch_sizes=(1, 3), contexts=(16,),
                                              margin=1.03, backend="reference")
    one, three = table.measured["points"]
    assert "invalid" not in one and one["chosen"] > 1  # 4 tokens in 30 ms beat 1 in 10 ms
    assert three["invalid"] and three["chosen"] == 1 and table.nodes == [[one["chosen"]], [1]]
    assert all(v == 0.0 for k, v in three.items() if k.startswith("nodes_"))
    assert "batch 3, context 16: speculative steps timed faster than a plain step" in capsys.readouterr().out
    assert budget_search.implausible_steps(0.01, {2: 0.0095, 3: -1.0, 4: 0.008}) == {3: -1.0, 4: 0.008}
    assert budget_search.implausible_steps(-0.01, {2: 0.02, 3: 0.0}) == {2: 0.02, 3: 0.0}  # plain itself failed
    fake[None] = -0.010  # a failed plain timing: every budget invalid, plain steps everywhere
    table = budget_search.search_budget_table(model, d, PROMPTS, tree_arg=tree, batch_sizes=(1,), contexts=(16,),
                                              margin=1.03, backend="reference")
    assert table.nodes == [[1]] and table.measured["points"][0]["invalid"]
    assert budget_search.rechoose(table, 0.0).nodes == [[1]]  # re-choosing keeps an invalid point plain


def test_combined_budget_caps_the_merged_draft(model):
    """The combined drafter (n-gram + heads) offers every budget up to its whole draft; a step held to n
    nodes proposes at most n per sequence, and the output stays plain greedy's."""
    d, tree = make(model, "combined")
    assert d.budget_levels(d.resolve_tree(tree, "cpu")) == tuple(range(1, 17))  # 6 heads' + 10 n-gram nodes
    prompts = [[5, 17, 3, 44, 9, 5, 17, 3], [8, 1, 60, 8, 1]]  # repeats: the n-gram part drafts
    plain = generate(model, prompts, max_new_tokens=12, eos_token_id=[]).sequences
    sizes, orig = [], d.propose
    d.propose = lambda state, root, seqlens: sizes.append(orig(state, root, seqlens)) or sizes[-1]
    for n in (3, 5):
        sizes.clear()
        out = generate(model, prompts, drafter=d, tree=tree, budget=n, max_new_tokens=12, eos_token_id=[])
        assert out.sequences == plain and set(out.step_nodes) == {n}
        assert sizes and max(p.tokens.shape[1] for p in sizes) == n


def test_combined_heads_draft_no_more_nodes_than_the_step_keeps(model):
    """The combined drafter's heads draft their subtree of at most the step's budget (a head runs per depth: at
    2 nodes the second head's draft would be dropped by the merge) and at most size_part's bound (the adaptive
    budget's); the output stays plain greedy's."""
    d, tree = make(model, "combined")
    prompts = [[5, 17, 3, 44, 9, 5, 17, 3], [8, 1, 60, 8, 1]]
    plain = generate(model, prompts, max_new_tokens=10, eos_token_id=[]).sequences
    drafted, orig = [], d.heads.propose
    d.heads.propose = lambda state, root, seqlens: drafted.append(orig(state, root, seqlens)) or drafted[-1]
    full = d.resolve_tree(tree, "cpu").heads_tree.num_nodes
    for n in (2, 3, 16):
        drafted.clear()
        out = generate(model, prompts, drafter=d, tree=tree, budget=n, max_new_tokens=10, eos_token_id=[])
        assert out.sequences == plain and {p.tree.num_nodes for p in drafted} == {min(n, full)}
    state = d.start(model, 2, 64, d.resolve_tree(tree, "cpu"), model.backend_plan("reference"))
    d.size_part(state, d.parts.index("heads"), 2)
    assert state.heads.tree.num_nodes == 2
    d.set_budget(state, 1 + full)  # the step's budget moves: the part's bound stays
    assert state.heads.tree.num_nodes == 2
    d.size_part(state, d.parts.index("heads"), None)
    assert state.heads.tree.num_nodes == full


@pytest.mark.parametrize("heads_kind", ["medusa", "hydra++", "eagle-static", "amphista"])
def test_combined_with_other_heads_at_small_budgets_is_plain_greedy(model, heads_kind):
    """Every static-tree family as the combined drafter's heads part, sized to budgets 2 and 3 (its subtree, the
    merge reading that subtree's own parents): plain greedy's tokens."""
    heads, tree = make(model, heads_kind)
    d = hk.new_drafter(model, kind="combined", drafters=[hk.new_drafter(model, kind="ngram"), heads])
    prompts = [[5, 17, 3, 44, 9, 5, 17, 3], [8, 1, 60, 8, 1]]
    plain = generate(model, prompts, max_new_tokens=8, eos_token_id=[]).sequences
    for n in (2, 3):
        out = generate(model, prompts, drafter=d, tree=tree, budget=n, max_new_tokens=8, eos_token_id=[])
        assert out.sequences == plain and max(out.step_nodes) == n


def test_step_timing_drafts_an_ngram_part_at_its_whole_budget(model, monkeypatch):
    """The search times steps from a synthetic state whose random text the n-gram lookup (almost) never matches
    at the real vocabulary (here: the lookup made to find nothing): the real combined (or n-gram) drafter would
    be timed at the heads' nodes alone (or none). The timed copy (timed_as_costliest) drafts its whole budget
    every step, the n-gram part first as for a long match."""
    from hydra_kernels.drafters import CombinedDrafter
    from hydra_kernels.drafters.ngram import NgramIndex
    from hydra_kernels.training.budget_search import _MatchingEveryStep, _synthetic_run, timed_as_costliest

    monkeypatch.setattr(NgramIndex, "lookup", lambda self, num_tokens, num_branches: (0, []))
    heads = randomised(hk.new_drafter(model, kind="hydra", num_heads=2), seed=3)
    combined = hk.new_drafter(model, kind="combined", drafters=[hk.new_drafter(model, kind="ngram"), heads], node_budget=6)
    ngram = hk.new_drafter(model, kind="ngram", num_tokens=5)
    backends = model.backend_plan("reference")
    branches = hk.new_drafter(model, kind="ngram", num_tokens=3, num_branches=2)  # 2 chains of 3: 7 nodes
    for d, tree_arg, budget, heads_only in ((combined, [[0], [0, 0]], 6, 3), (ngram, None, 6, 1), (branches, None, 7, 1)):
        tree = d.resolve_tree(tree_arg, "cpu")
        sizes = {}
        for name, timed in (("real", d), ("timed", timed_as_costliest(d))):
            seen, orig = [], timed.propose
            timed.propose = lambda state, root, seqlens, orig=orig, seen=seen: seen.append(orig(state, root, seqlens)) or seen[-1]
            _synthetic_run(model, timed, tree, 2, 24, budget, 5, backends, seed=0)
            sizes[name] = {p.tokens.shape[1] for p in seen}
        assert sizes["real"] == {heads_only} and sizes["timed"] == {budget}
        if isinstance(d, CombinedDrafter):
            assert isinstance(timed_as_costliest(d).ngram, _MatchingEveryStep) and timed_as_costliest(d).heads is d.heads
    assert timed_as_costliest(heads) is heads  # no n-gram part: timed as it is


def test_a_table_never_lifts_the_combined_drafters_node_budget(model):
    """A budget table asking for more nodes than the combined drafter's node_budget (searched before the cap was
    lowered: the tree key is the bound's, which node_budget does not change) drafts node_budget nodes."""
    heads = randomised(hk.new_drafter(model, kind="hydra", num_heads=2), seed=4)
    d = hk.new_drafter(model, kind="combined", drafters=[hk.new_drafter(model, kind="ngram"), heads], node_budget=4)
    bound = d.resolve_tree(None, "cpu")
    d.budget_tables["cpu"] = BudgetTable(device="cpu", tree=tree_key(bound), full=bound.num_nodes, batch_sizes=[1],
                                         contexts=[16], nodes=[[6]])
    prompts = [[5, 17, 3, 44, 9, 5, 17, 3], [8, 1, 60, 8, 1]]
    seen, orig = [], d.propose
    d.propose = lambda state, root, seqlens: seen.append(orig(state, root, seqlens)) or seen[-1]
    out = generate(model, prompts, drafter=d, budget="auto", max_new_tokens=12, eos_token_id=[])
    assert out.sequences == generate(model, prompts, max_new_tokens=12, eos_token_id=[]).sequences
    assert set(out.step_nodes) == {6} and seen and max(p.tokens.shape[1] for p in seen) <= 4


def test_whole_tree_budget_of_a_drafter_held_to_fewer_nodes(model):
    """A combined drafter with node_budget runs at most that many nodes: its whole-tree budget is that, not its
    bound's size (which generate() would refuse as a budget it cannot run)."""
    heads = hk.new_drafter(model, kind="hydra", num_heads=2)
    d = hk.new_drafter(model, kind="combined", drafters=[hk.new_drafter(model, kind="ngram"), heads], node_budget=4)
    assert d.resolve_tree(None, "cpu").num_nodes > 4 and whole_tree_budget(d, None, "cpu") == 4
    out = generate(model, PROMPTS, drafter=d, budget=whole_tree_budget(d, None, "cpu"), max_new_tokens=12,
                   eos_token_id=[])
    assert out.sequences == generate(model, PROMPTS, max_new_tokens=12, eos_token_id=[]).sequences
    assert set(out.step_nodes) == {4}

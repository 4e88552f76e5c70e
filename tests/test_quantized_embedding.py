"""model/quantized_embedding.py: a tied quantized checkpoint's embedding served from the LM head's panels. Lookups
give the dequantized table's rows bit for bit (any id shape, int32 or int64); bad ids are refused with a clear
error; state_dict, load_state_dict and .to() see the real fp32 table, and a no-op move returns to the panels."""
import pytest
import torch

from hydra_kernels.model.quantized_embedding import QuantizedEmbedding
from hydra_kernels.ops.quantized_linear import quantized_linear_available
from test_quantized_linear import random_blocks

pytestmark = pytest.mark.skipif(not quantized_linear_available(), reason="the quantized CPU kernel")


def embedding(seed: int = 0, V: int = 130, H: int = 64) -> QuantizedEmbedding:
    return QuantizedEmbedding(random_blocks(V, H, 32, 8, False, torch.Generator().manual_seed(seed)).panels())


def test_lookups_are_the_tables_rows():
    e = embedding()
    table = e.dense()
    assert e.weight.is_meta and e.weight.shape == (130, 64) and table.dtype == torch.float32
    gen = torch.Generator().manual_seed(1)
    for shape in [(1, 1), (3, 7), (5,), (2, 3, 4)]:
        ids = torch.randint(0, 130, shape, generator=gen)
        for dt in (torch.int64, torch.int32):
            got = e(ids.to(dt))
            assert got.shape == (*shape, 64) and torch.equal(got, table[ids])
    assert e(torch.empty(0, 3, dtype=torch.long)).shape == (0, 3, 64)


def test_bad_ids_are_refused():
    e = embedding()
    with pytest.raises(IndexError, match=r"\[0, 130\)"):
        e(torch.tensor([[3, 130]]))
    with pytest.raises(IndexError, match=r"\[0, 130\)"):
        e(torch.tensor([-1]))
    with pytest.raises(ValueError, match="int32/int64"):
        e(torch.tensor([1.0]))


def test_state_dict_load_and_moves_see_the_fp32_table():
    e = embedding(2)
    table = e.dense()
    sd = e.state_dict()
    assert torch.equal(sd["weight"], table)
    e.to("cpu")  # a no-op move: still the panels only
    assert e.weight.is_meta and e.panels is not None
    e.double()  # a real conversion: the table comes back, converted
    assert e.panels is None and e.weight.dtype == torch.float64 and torch.equal(e.weight, table.double())
    f = embedding(3)
    f.load_state_dict(sd)  # loading writes a real table
    assert f.panels is None and torch.equal(f.weight, table) and torch.equal(f(torch.tensor([4])), table[[4]])

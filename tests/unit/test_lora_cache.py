"""LR cache (PReCache): LR-split attention equals ordinary LoRA attention; pool; schedules."""

import pytest
import torch

from sglang_kvshare.lora_cache import (
    AttentionSpan,
    LoRAProjection,
    OwnLRColumn,
    flash_lora_attention,
    flash_lora_attention_qkvo,
    lora_attention_naive,
    lr_values,
    own_span,
    stack_adapters,
)
from sglang_kvshare.rope.align import RopeSpec, inv_freq_for, shift_keys
from tests.lr_cache_sim import LRCacheConfig, LRCachePool, prelr_shared, rebase_shared

torch.set_num_threads(1)

HIDDEN, HQ, HKV, D = 96, 9, 3, 64  # SmolLM2's head layout (9 q heads over 3 KV heads)
KV_DIM = HKV * D
ATOL = 2e-5


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _adapter(d_out, rank=8, seed=1, alpha=16):
    g = _gen(seed)
    return LoRAProjection(
        A=torch.randn(rank, HIDDEN, generator=g) / HIDDEN**0.5,
        B=torch.randn(rank, d_out, generator=g) * 0.5,
        scaling=alpha / rank,
    )


def _layer(T, seed=0):
    """Hidden states x [T, HIDDEN], base projections W_v, W_k [HIDDEN, KV_DIM], queries."""
    g = _gen(seed)
    x = torch.randn(T, HIDDEN, generator=g)
    W_v = torch.randn(HIDDEN, KV_DIM, generator=g) / HIDDEN**0.5
    W_k = torch.randn(HIDDEN, KV_DIM, generator=g) / HIDDEN**0.5
    return x, W_v, W_k


@pytest.mark.parametrize("q_len,kv_len", [(7, 7), (5, 12), (1, 12)], ids=["prefill", "extend", "decode"])
def test_lr_split_equals_lora_attention_single_agent(q_len, kv_len):
    x, W_v, W_k = _layer(kv_len)
    ad = _adapter(KV_DIM)
    q = torch.randn(q_len, HQ, D, generator=_gen(5))
    k = (x @ W_k).view(kv_len, HKV, D)
    v_base = (x @ W_v).view(kv_len, HKV, D)
    v_lora = (x @ W_v + ad.delta(x)).view(kv_len, HKV, D)  # ordinary LoRA value
    lr = lr_values(x, ad.A, ad.scaling)
    assert lr.shape == (kv_len, 8)

    out = flash_lora_attention(q, k, v_base, lr, ad.B)
    ref = lora_attention_naive(q, k, v_lora, None, None)
    assert out.shape == (q_len, HQ, D)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(lora_attention_naive(q, k, v_base, lr, ad.B), ref, atol=ATOL, rtol=1e-5)

    # negative control: without the LR term the output is the base model's, clearly different
    base_only = flash_lora_attention(q, k, v_base, None, None)
    assert (base_only - ref).abs().max() > 1e-2


def test_gqa_heads_read_their_kv_head():
    """Query heads 0-2 read KV head 0 and B columns [0, D): perturbing KV head 1's B columns
    leaves them unchanged and changes heads 3-5."""
    x, W_v, W_k = _layer(10)
    ad = _adapter(KV_DIM)
    q = torch.randn(4, HQ, D, generator=_gen(2))
    k, v = (x @ W_k).view(10, HKV, D), (x @ W_v).view(10, HKV, D)
    lr = lr_values(x, ad.A, ad.scaling)
    B2 = ad.B.clone()
    B2[:, D : 2 * D] += 1.0
    a, b = flash_lora_attention(q, k, v, lr, ad.B), flash_lora_attention(q, k, v, lr, B2)
    assert torch.equal(a[:, :3], b[:, :3]) and torch.equal(a[:, 6:], b[:, 6:])
    assert (a[:, 3:6] - b[:, 3:6]).abs().max() > 1e-2


def test_non_causal_and_span():
    span = AttentionSpan(q_len=2, kv_len=5)
    assert span.start == 3 and span.mask().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    x, W_v, W_k = _layer(6)
    ad = _adapter(KV_DIM)
    q = torch.randn(3, HQ, D, generator=_gen(3))
    k, v = (x @ W_k).view(6, HKV, D), (x @ W_v).view(6, HKV, D)
    lr = lr_values(x, ad.A, ad.scaling)
    torch.testing.assert_close(
        flash_lora_attention(q, k, v, lr, ad.B, causal=False),
        lora_attention_naive(q, k, v, lr, ad.B, causal=False),
        atol=ATOL,
        rtol=1e-5,
    )


def test_several_agents_share_base_and_pool():
    """Three agents (ranks 8, 8, 4) over one shared base cache: each agent's attention with its
    LR column from the pool equals ordinary LoRA attention with that agent's adapter."""
    T, num_slots = 11, 32
    x, W_v, W_k = _layer(T)
    adapters = [_adapter(KV_DIM, 8, seed=10), _adapter(KV_DIM, 8, seed=11), _adapter(KV_DIM, 4, seed=12)]
    A_all, B_all, scaling = stack_adapters(adapters)
    pool = LRCachePool(
        LRCacheConfig(num_layers=2, num_slots=num_slots, max_agents=4, max_rank=8, num_kv_heads=HKV, head_dim=D)
    )
    names = ["solver", "critic", "final"]
    cols = [pool.register_agent(n, a.rank) for n, a in zip(names, adapters)]
    assert cols == [0, 1, 2] and pool.register_agent("critic", 8) == 1

    slots = torch.randperm(num_slots, generator=_gen(4))[:T]  # token slots owned by the KV pool
    write = prelr_shared(x, A_all, scaling)
    pool.write(1, slots, write.lr)
    k, v_base = (x @ W_k).view(T, HKV, D), (x @ W_v).view(T, HKV, D)
    q = torch.randn(3, HQ, D, generator=_gen(6))
    outs = []
    for name, ad in zip(names, adapters):
        lr = pool.read(1, slots, name)
        assert lr.shape == (T, ad.rank)
        torch.testing.assert_close(lr, lr_values(x, ad.A, ad.scaling), atol=1e-5, rtol=1e-5)
        out = flash_lora_attention(q, k, v_base, lr, ad.B)
        ref = lora_attention_naive(q, k, (x @ W_v + ad.delta(x)).view(T, HKV, D), None, None)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
        outs.append(out)
    assert (outs[0] - outs[1]).abs().max() > 1e-2  # agents really differ
    assert pool.buffer(0).abs().sum() == 0  # other layers untouched


def test_lr_values_all_agents_matches_per_agent():
    x = torch.randn(5, HIDDEN, generator=_gen(7))
    ads = [_adapter(KV_DIM, 8, seed=20), _adapter(KV_DIM, 2, seed=21)]
    A_all, B_all, s = stack_adapters(ads)
    assert A_all.shape == (2, 8, HIDDEN) and B_all.shape == (2, 8, KV_DIM)
    lr = lr_values(x, A_all, s)
    assert lr.shape == (5, 2, 8)
    for i, ad in enumerate(ads):
        torch.testing.assert_close(lr[:, i, : ad.rank], lr_values(x, ad.A, ad.scaling))
    assert torch.all(lr[:, 1, 2:] == 0)


def test_pool_contract_and_byte_accounting():
    cfg = LRCacheConfig(num_layers=30, num_slots=100, max_agents=3, max_rank=8, num_kv_heads=HKV, head_dim=D)
    pool = LRCachePool(cfg)
    for n in ("a", "b", "c"):
        pool.register_agent(n, 8)
    with pytest.raises(ValueError):
        pool.register_agent("d", 8)  # full
    with pytest.raises(ValueError):
        pool.register_agent("a", 4)  # rank changed
    with pytest.raises(KeyError):
        pool.buffer(0, "key")  # QV pool has no key LR

    itemsize = 4
    full_kv_per_token_agent = cfg.num_layers * 2 * cfg.kv_dim * itemsize  # K and V
    assert pool.nbytes() == cfg.num_layers * 100 * 3 * 8 * itemsize
    per_agent = pool.nbytes_per_token(1)
    assert per_agent / full_kv_per_token_agent == pytest.approx(8 / (2 * KV_DIM))  # r/(2 kv_dim)
    assert pool.nbytes() == pool.nbytes_per_token() * cfg.num_slots

    qkvo = LRCachePool(LRCacheConfig(30, 100, 3, 8, HKV, D, key_lr=True))
    assert qkvo.nbytes() == 2 * pool.nbytes()
    assert qkvo.nbytes_per_token(1) / full_kv_per_token_agent == pytest.approx(8 / KV_DIM)

    # single-agent writes touch one column; slots are reused by overwriting
    slots = torch.tensor([3, 7])
    pool.write(0, slots, torch.ones(2, 8), agent="b")
    assert pool.buffer(0)[slots, 1].eq(1).all() and pool.buffer(0)[slots, 0].eq(0).all()
    pool.write(0, slots, torch.full((2, 3, 8), 2.0))
    assert pool.read(0, slots, "c").eq(2).all()


def test_qkvo_key_lr_equals_materialised_lora_keys():
    """K = RoPE(X W_k + s X A_k B_k) equals K_base + RoPE(LR_k B_k) inside attention."""
    T = 9
    x, W_v, W_k = _layer(T, seed=8)
    ad_v, ad_k = _adapter(KV_DIM, 8, seed=30), _adapter(KV_DIM, 8, seed=31)
    rope = RopeSpec(inv_freq_for(D, 100000.0), D, is_neox=True)
    pos = torch.arange(T) + 3  # keys at positions 3..11
    k_base = shift_keys((x @ W_k).view(T, HKV, D), pos, rope)
    k_lora = shift_keys((x @ W_k + ad_k.delta(x)).view(T, HKV, D), pos, rope)
    v_base = (x @ W_v).view(T, HKV, D)
    v_lora = (x @ W_v + ad_v.delta(x)).view(T, HKV, D)
    q = torch.randn(4, HQ, D, generator=_gen(9))

    out = flash_lora_attention_qkvo(
        q,
        k_base,
        v_base,
        lr_values(x, ad_v.A, ad_v.scaling),
        ad_v.B,
        lr_values(x, ad_k.A, ad_k.scaling),
        ad_k.B,
        rope,
        key_positions=pos,
    )
    ref = lora_attention_naive(q, k_lora, v_lora, None, None)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
    no_key_lr = flash_lora_attention(q, k_base, v_base, lr_values(x, ad_v.A, ad_v.scaling), ad_v.B)
    assert (no_key_lr - ref).abs().max() > 1e-3  # the key delta matters


def test_schedules():
    T = 6
    g = _gen(12)
    x_adpt, x_neut = torch.randn(T, HIDDEN, generator=g), torch.randn(T, HIDDEN, generator=g)
    ads = [_adapter(KV_DIM, 8, seed=40 + i) for i in range(3)]
    A_all, _, s = stack_adapters(ads)

    pre = prelr_shared(x_adpt, A_all, s)
    assert pre.base_source == "adapted" and pre.lr.shape == (T, 3, 8)
    torch.testing.assert_close(pre.lr, lr_values(x_adpt, A_all, s))

    re = rebase_shared(x_adpt, x_neut, A_all, s, current_agent=1)
    assert re.base_source == "neutral"
    torch.testing.assert_close(re.lr[:, 1], lr_values(x_adpt, ads[1].A, ads[1].scaling))
    for j in (0, 2):
        torch.testing.assert_close(re.lr[:, j], lr_values(x_neut, ads[j].A, ads[j].scaling))
    assert pre.columns == re.columns == (0, 1, 2)

    # LP: the turn writes column 1 from x_adpt, the post-turn prefill the others from x_neut;
    # the pool ends in the same state as DB (one rebase_shared write with both passes)
    cfg = LRCacheConfig(1, 16, 3, 8, HKV, D)
    db, lp = LRCachePool(cfg), LRCachePool(cfg)
    for pool in (db, lp):
        assert [pool.register_agent(n, 8) for n in "abc"] == [0, 1, 2]
    slots = torch.tensor([2, 5, 6, 9, 11, 15])
    db.write(0, slots, re.lr, columns=re.columns)
    lp.write(0, slots, lr_values(x_adpt, ads[1].A, ads[1].scaling), agent="b")  # during the turn
    lp_post = rebase_shared(None, x_neut, A_all, s, current_agent=1)  # post-turn prefill
    assert lp_post.columns == (0, 2)
    lp.write(0, slots, lp_post.lr, columns=lp_post.columns)
    torch.testing.assert_close(lp.buffer(0), db.buffer(0))


def test_own_column_puts_the_adapted_column_over_the_neutral_pass():
    """The engine's ReBaseShared: the adapter-free pass writes every column from x_neut, then
    agent j's column is put from the adapted pass's rows (``OwnLRColumn``): the pool ends as the
    paper's ``rebase_shared`` write, value and key buffers alike, other columns untouched."""
    T, j = 6, 1
    g = _gen(13)
    x_adpt, x_neut = torch.randn(T, HIDDEN, generator=g), torch.randn(T, HIDDEN, generator=g)
    ads = [_adapter(KV_DIM, 8, seed=50 + i) for i in range(3)]
    A_all, _, s = stack_adapters(ads)
    want = rebase_shared(x_adpt, x_neut, A_all, s, current_agent=j).lr  # [T, 3, 8]
    tokens = list(range(100, 100 + T))
    start = 4  # positions 4..9: the turn's computed rows
    bufs = [torch.zeros(32, 3, 8) for _ in range(4)]  # value and key LR of two layers
    adapted = torch.tensor([20, 21, 22, 23, 24, 25])  # the adapted turn's rows (freed later)
    rebuilt = torch.tensor([3, 7, 8, 12, 13, 30])  # the adapter-free pass's rows
    for b in bufs:
        b[adapted] = lr_values(x_adpt, A_all, s)
        b[rebuilt] = lr_values(x_neut, A_all, s)
    kept = OwnLRColumn.take(bufs, adapted, j, start, tokens)
    assert kept.nbytes() == 4 * T * 8 * 4 and kept.end == start + T
    for b in bufs:
        b[adapted] = -1.0  # the slots are reused: the kept copy does not change
    assert kept.put(bufs, rebuilt, start, tokens) == T
    for b in bufs:
        torch.testing.assert_close(b[rebuilt], want)


def test_own_column_put_only_where_positions_and_tokens_match():
    bufs = [torch.zeros(16, 2, 4)]
    src = torch.arange(4)  # positions 10..13
    bufs[0][src, 1] = torch.arange(1.0, 5.0)[:, None]
    kept = OwnLRColumn.take(bufs, src, 1, 10, [5, 6, 7, 8])
    # a later chunk of the rebuild: positions 12..15, only 12 and 13 were the turn's
    assert kept.put(bufs, torch.tensor([8, 9, 10, 11]), 12, [7, 8, 9, 9]) == 2
    assert bufs[0][8:12, 1, 0].tolist() == [3.0, 4.0, 0.0, 0.0]
    assert bufs[0][8:12, 0].abs().sum() == 0  # other columns untouched
    # a token differs at position 11: nothing from there on
    assert kept.put(bufs, torch.tensor([12, 13, 14]), 10, [5, 0, 7]) == 1
    assert bufs[0][12:15, 1, 0].tolist() == [1.0, 0.0, 0.0]
    assert kept.put(bufs, torch.tensor([15]), 3, [1]) == 0  # before the turn's rows
    with pytest.raises(ValueError):
        kept.put(bufs, torch.tensor([1, 2]), 10, [5])
    with pytest.raises(ValueError):  # the buffers were re-made at another rank
        kept.put([torch.zeros(16, 2, 8)], torch.tensor([1]), 10, [5])


def test_own_span():
    assert own_span((4, 20), (6, 18)) == (6, 18)  # the twin hit 2 more cached tokens
    assert own_span((4, 20), (6, 18), since=17) == (17, 18)  # only what the forward added
    assert own_span((0, 10), (10, 12)) is None
    assert own_span((0, 5), (0, 5), since=5) is None

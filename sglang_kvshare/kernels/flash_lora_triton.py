"""The Flash-LoRA-Attention Triton kernel (one program per request, query head and block of
queries). Contract, layouts and launcher: ``kernels.flash_lora_attention``."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships with torch on CUDA machines
    HAS_TRITON = False
    flash_lora_attention_kernel = None


if HAS_TRITON:

    @triton.jit
    def flash_lora_attention_kernel(
        Q,
        K,
        V,
        LR,
        BV,
        O,  # noqa: E741 (the kernel's names are the math's)
        KV_IDX,
        QO_INDPTR,
        KV_INDPTR,
        AGENT,
        LRK,
        BK,
        COS,
        SIN,
        SHIFT,
        SCOS,
        SSIN,
        shift_lo,
        LWHICH,
        LROW,
        LTAB,
        LAK,
        LAV,
        LBK,
        LBV,
        sm_scale,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_lrt,
        stride_lra,
        stride_ba,
        stride_br,
        stride_ot,
        stride_oh,
        stride_lkt,
        stride_lka,
        stride_bka,
        stride_bkr,
        stride_cs,
        stride_ss,
        stride_tab,
        stride_lak,
        stride_lav,
        stride_lbka,
        stride_lbkr,
        stride_lbva,
        stride_lbvr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        RANK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_LR: tl.constexpr,
        HAS_KEY_LR: tl.constexpr,
        HAS_SHIFT: tl.constexpr,
        PRECISION: tl.constexpr,
        HAS_LEAF: tl.constexpr,
        NLEAF: tl.constexpr,
        LRANK: tl.constexpr,
        BLOCK_RL: tl.constexpr,
        BLOCK_L: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        mblk = tl.program_id(2)
        g = h // GROUP
        q_beg = tl.load(QO_INDPTR + b)
        q_len = tl.load(QO_INDPTR + b + 1) - q_beg
        kv_beg = tl.load(KV_INDPTR + b)
        kv_len = tl.load(KV_INDPTR + b + 1) - kv_beg
        if mblk * BLOCK_M < q_len:
            q_start = kv_len - q_len
            agent = tl.load(AGENT + b)
            offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            offs_r = tl.arange(0, BLOCK_R)
            m_mask = offs_m < q_len
            d_mask = offs_d < HEAD_DIM
            r_mask = offs_r < tl.where(agent >= 0, RANK, 0)  # base-model request: no LR
            agent_c = tl.maximum(agent, 0)
            # q: [BLOCK_M, BLOCK_D]
            q = tl.load(
                Q + (q_beg + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            acc_lr = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            half: tl.constexpr = HEAD_DIM // 2
            rot_d = tl.where(offs_d < half, offs_d + half, offs_d - half)  # rotate_half's gather
            sign = tl.where(offs_d < half, -1.0, 1.0)
            if HAS_KEY_LR:
                rd_mask = r_mask[:, None] & d_mask[None, :]
                bk_base = BK + agent_c * stride_bka + offs_r[:, None] * stride_bkr + g * HEAD_DIM
                # bk, bk_rh: [BLOCK_R, BLOCK_D]; bk_rh = rotate_half(B^K) along D
                bk = tl.load(bk_base + offs_d[None, :], mask=rd_mask, other=0.0).to(tl.float32)
                bk_rh = tl.load(bk_base + rot_d[None, :], mask=rd_mask, other=0.0).to(tl.float32)
                bk_rh = bk_rh * sign[None, :]
            if HAS_LEAF:
                # column c of the stack: row c % BLOCK_RL of the request's leaf c // BLOCK_RL
                offs_l = tl.arange(0, BLOCK_L)
                l_of, r_of = offs_l // BLOCK_RL, offs_l % BLOCK_RL
                lid = tl.load(LTAB + b * stride_tab + l_of, mask=l_of < NLEAF, other=-1)
                l_ok = (lid >= 0) & (r_of < LRANK)
                ld_mask = l_ok[:, None] & d_mask[None, :]
                lid = tl.maximum(lid, 0)
                # lbk, lbk_rh, lbv: [BLOCK_L, BLOCK_D] (KV head g's columns of each leaf's B)
                lbk_base = LBK + lid[:, None] * stride_lbka + r_of[:, None] * stride_lbkr + g * HEAD_DIM
                lbk = tl.load(lbk_base + offs_d[None, :], mask=ld_mask, other=0.0).to(tl.float32)
                lbk_rh = tl.load(lbk_base + rot_d[None, :], mask=ld_mask, other=0.0).to(tl.float32)
                lbk_rh = lbk_rh * sign[None, :]
                lbv = tl.load(
                    LBV + lid[:, None] * stride_lbva + r_of[:, None] * stride_lbvr + g * HEAD_DIM + offs_d[None, :],
                    mask=ld_mask,
                    other=0.0,
                ).to(tl.float32)
                acc_leaf = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
            kv_end = kv_len
            if CAUSAL:
                kv_end = tl.minimum(kv_len, q_start + (mblk + 1) * BLOCK_M)
            for n0 in range(0, kv_end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < kv_len
                slot = tl.load(KV_IDX + kv_beg + offs_n, mask=n_mask, other=0).to(tl.int64)
                nd_mask = n_mask[:, None] & d_mask[None, :]
                # k: [BLOCK_N, BLOCK_D]
                k = tl.load(
                    K + slot[:, None] * stride_kt + g * stride_kh + offs_d[None, :], mask=nd_mask, other=0.0
                ).to(tl.float32)
                if HAS_SHIFT:
                    k_rh = (
                        tl.load(
                            K + slot[:, None] * stride_kt + g * stride_kh + rot_d[None, :], mask=nd_mask, other=0.0
                        ).to(tl.float32)
                        * sign[None, :]
                    )
                if HAS_LEAF:
                    # ak, av: [BLOCK_N, BLOCK_L]; a key's A row in the columns of its leaf
                    lrow = tl.load(LROW + kv_beg + offs_n, mask=n_mask, other=-1)
                    lwh = tl.load(LWHICH + kv_beg + offs_n, mask=n_mask, other=-1)
                    a_mask = (lrow >= 0)[:, None] & (lwh[:, None] == l_of[None, :]) & l_ok[None, :]
                    lrow = tl.maximum(lrow, 0).to(tl.int64)
                    ak = tl.load(LAK + lrow[:, None] * stride_lak + r_of[None, :], mask=a_mask, other=0.0).to(
                        tl.float32
                    )
                    av = tl.load(LAV + lrow[:, None] * stride_lav + r_of[None, :], mask=a_mask, other=0.0).to(
                        tl.float32
                    )
                    k += tl.dot(ak, lbk, input_precision=PRECISION)
                    if HAS_SHIFT:
                        k_rh += tl.dot(ak, lbk_rh, input_precision=PRECISION)
                if HAS_SHIFT:
                    # the key turned by its shift: cos * k + sin * rotate_half(k)
                    row = tl.load(SHIFT + kv_beg + offs_n, mask=n_mask, other=shift_lo) - shift_lo
                    cs = row[:, None] * stride_ss + offs_d[None, :]
                    k = k * tl.load(SCOS + cs, mask=nd_mask, other=0.0) + k_rh * tl.load(
                        SSIN + cs, mask=nd_mask, other=0.0
                    )
                if HAS_KEY_LR:
                    # lrk: [BLOCK_N, BLOCK_R]; key delta RoPE(lrk @ B^K) at positions offs_n
                    lrk = tl.load(
                        LRK + slot[:, None] * stride_lkt + agent_c * stride_lka + offs_r[None, :],
                        mask=n_mask[:, None] & r_mask[None, :],
                        other=0.0,
                    ).to(tl.float32)
                    cos = tl.load(COS + offs_n[:, None] * stride_cs + offs_d[None, :], mask=nd_mask, other=0.0)
                    sin = tl.load(SIN + offs_n[:, None] * stride_cs + offs_d[None, :], mask=nd_mask, other=0.0)
                    k += cos * tl.dot(lrk, bk, input_precision=PRECISION)
                    k += sin * tl.dot(lrk, bk_rh, input_precision=PRECISION)
                # s: [BLOCK_M, BLOCK_N]
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
                valid = m_mask[:, None] & n_mask[None, :]
                if CAUSAL:
                    valid = valid & (offs_n[None, :] <= (q_start + offs_m)[:, None])
                s = tl.where(valid, s, -1.0e30)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.exp(s - m_new[:, None])
                p = tl.where(valid, p, 0.0)
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(
                    V + slot[:, None] * stride_vt + g * stride_vh + offs_d[None, :], mask=nd_mask, other=0.0
                ).to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
                if HAS_LR:
                    # lr: [BLOCK_N, BLOCK_R]
                    lr = tl.load(
                        LR + slot[:, None] * stride_lrt + agent_c * stride_lra + offs_r[None, :],
                        mask=n_mask[:, None] & r_mask[None, :],
                        other=0.0,
                    ).to(tl.float32)
                    acc_lr = acc_lr * alpha[:, None] + tl.dot(p, lr, input_precision=PRECISION)
                if HAS_LEAF:
                    acc_leaf = acc_leaf * alpha[:, None] + tl.dot(p, av, input_precision=PRECISION)
                m_i = m_new
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            acc = acc / l_safe[:, None]
            if HAS_LR:
                acc_lr = acc_lr / l_safe[:, None]
                # bv: [BLOCK_R, BLOCK_D], KV head g's columns of agent's B_v
                bv = tl.load(
                    BV + agent_c * stride_ba + offs_r[:, None] * stride_br + g * HEAD_DIM + offs_d[None, :],
                    mask=r_mask[:, None] & d_mask[None, :],
                    other=0.0,
                ).to(tl.float32)
                acc += tl.dot(acc_lr, bv, input_precision=PRECISION)
            if HAS_LEAF:
                acc += tl.dot(acc_leaf / l_safe[:, None], lbv, input_precision=PRECISION)
            tl.store(
                O + (q_beg + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                acc.to(O.dtype.element_ty),
                mask=m_mask[:, None] & d_mask[None, :],
            )

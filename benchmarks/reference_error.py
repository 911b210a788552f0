"""Why the non-chained correction baselines lose to uncorrected reuse on SmolLM2 (KVCMAS sec. 3.2,
fig. 3): the relative KV error of agent 1's question slot, over MMLU tasks, when it is taken
(a) from agent 0's cache (fullshared), (b) corrected from it (chained KVCMAS), (c) from the
context-free reference as the engine prefills it today (the question alone) and under other
neutral prefixes, uncorrected and corrected by the non-chained KVCMAS corrector. Anchors of each
task are the other tasks' observations (up to 10), every gate open (tau 1). The chained
correction also runs at other temperatures T of its token weights (eq. 8; the default is 1):
T -> 0 takes each token's delta from its nearest anchor, a large T averages all anchors' deltas.
HF transformers on the default model, float32, no server.

    python -m benchmarks.reference_error [N_TASKS]
"""

import json
import sys
from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from sglang_kvshare.assets import ensure_default_model
from sglang_kvshare.rope.align import RopeSpec, inv_freq_for, shift_keys
from sglang_kvshare.correction import SegmentKV
from sglang_kvshare.correction.kvcmas import KVCMASCorrector, KVCMASNonChainedCorrector
from sglang_kvshare.workflows import get_roles
from benchmarks.datasets import load_tasks


class HFModel:
    """The default model in HF transformers, float32, 2 threads: exact segment caches."""

    def __init__(self):
        torch.set_num_threads(2)
        path = ensure_default_model()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        self.cfg = self.model.config
        hd = self.cfg.hidden_size // self.cfg.num_attention_heads
        theta = json.load(open(f"{path}/config.json"))["rope_parameters"]["rope_theta"]
        self.rope = RopeSpec(inv_freq_for(hd, theta, None), hd, True)

    def enc(self, text):
        return self.tok.encode(text, add_special_tokens=False)

    def system_ids(self, role):
        return self.enc("<|im_start|>system\n" + role.system_prompt + "<|im_end|>\n<|im_start|>user\n")

    @torch.no_grad()
    def segment_kv(self, prefix_ids, seg_ids) -> SegmentKV:
        """K (re-aligned to position 0) and V of ``seg_ids`` after ``prefix_ids``, [L, n, H*D]."""
        pkv = self.model(torch.tensor([prefix_ids + seg_ids]), use_cache=True).past_key_values
        ks, vs = [], []
        for i in range(self.cfg.num_hidden_layers):
            k = pkv.layers[i].keys[0] if hasattr(pkv, "layers") else pkv.key_cache[i][0]
            v = pkv.layers[i].values[0] if hasattr(pkv, "layers") else pkv.value_cache[i][0]
            k = k[:, len(prefix_ids) :].transpose(0, 1)  # [T, H, hd]
            v = v[:, len(prefix_ids) :].transpose(0, 1)
            k = shift_keys(k, -len(prefix_ids), self.rope)
            ks.append(k.reshape(k.shape[0], -1))
            vs.append(v.reshape(v.shape[0], -1))
        return SegmentKV(torch.stack(ks), torch.stack(vs))


def err(a, b):
    """Relative KV error ||a - b|| / ||b|| over keys and values of all layers."""
    num = (a.k - b.k).square().sum() + (a.v - b.v).square().sum()
    return float((num / (b.k.square().sum() + b.v.square().sum())).sqrt())


TEMPERATURES = (0.03, 0.1, 0.3, 1.0, 3.0, 100.0)


def main():
    hf = HFModel()
    roles = get_roles("mmlu").roles
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    tasks = load_tasks("mmlu", N, seed=5)
    enc, seg_kv, sys_ids = hf.enc, hf.segment_kv, hf.system_ids

    PREFIXES = {
        "none (today)": [],
        "<|im_start|>": enc("<|im_start|>"),
        "<|im_start|>user\\n": enc("<|im_start|>user\n"),
        "<|im_start|>system\\n<|im_end|>\\n<|im_start|>user\\n": enc(
            "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n"
        ),
    }
    data = []
    for t in tasks:
        q = enc(t.question)
        c0, c1 = seg_kv(sys_ids(roles[0]), q), seg_kv(sys_ids(roles[1]), q)
        refs = {n: seg_kv(p, q) for n, p in PREFIXES.items()}
        data.append((c0, c1, refs))
        print(t.id, len(q), flush=True)
    rows = {"fullshared (agent 0's cache)": [], "kvcmas chained": []}
    for n in PREFIXES:
        rows[f"ref {n}, uncorrected"] = []
        rows[f"ref {n}, corrected (nonchained)"] = []
    for i, (c0, c1, refs) in enumerate(data):
        others = [d for j, d in enumerate(data) if j != i][:10]
        rows["fullshared (agent 0's cache)"].append(err(c0, c1))
        ch = KVCMASCorrector()
        for o0, o1, _ in others:
            ch.observe("q", "a0", "a1", o0, o1)
        for T in TEMPERATURES:  # the token weights' temperature is read at correct() only
            ch.config = replace(ch.config, temperature=T)
            r = ch.correct("q", "a0", "a1", c0, tau=1.0)
            name = "kvcmas chained" + ("" if T == KVCMASCorrector.default_config.temperature else f", T = {T}")
            rows.setdefault(name, []).append(err(r.kv, c1) if r.accepted else float("nan"))
        for n in PREFIXES:
            rows[f"ref {n}, uncorrected"].append(err(refs[n], c1))
            nc = KVCMASNonChainedCorrector()
            for o0, o1, orefs in others:
                nc.observe("q", "a0", "a1", o0, o1, orefs[n])
            r = nc.correct("q", "a0", "a1", c0, refs[n], tau=1.0)
            rows[f"ref {n}, corrected (nonchained)"].append(err(r.kv, c1) if r.accepted else float("nan"))
    print("\n| cache for agent 1's question slot | rel. KV error mean | max |\n|---|---:|---:|")
    for k, v in rows.items():
        t = torch.tensor(v)
        print(f"| {k} | {float(t.nanmean()):.4f} | {float(t[~t.isnan()].max()):.4f} |")


if __name__ == "__main__":
    main()

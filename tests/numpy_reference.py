"""An independent float64 numpy forward of a ModelOpt FP8 Llama/Qwen2 checkpoint (test oracle).

Written separately from the package (own safetensors parsing, no fusion, no JAX) and in float64,
so that it isolates rounding choices: FP8 codes are taken with the same rules, every other op is
exact to float64. ``trace`` collects, for every quantizer (static per-tensor, dynamic per-token,
KV cache), the value divided by its scale, so tests can see how close an input sits to an FP8
rounding boundary. ``flips`` makes chosen quantizer elements round to the *other* neighbouring FP8
code, so a test can show that a float32 result is this oracle with one near-tie rounded the other way.
"""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np

_DT = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F16": np.float16}


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
    files = [os.path.join(directory, "model.safetensors")]
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted({os.path.join(directory, f) for f in json.load(open(index))["weight_map"].values()})
    out = {}
    for path in files:
        blob = open(path, "rb").read()
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8:8 + n])
        for name, e in header.items():
            if name == "__metadata__":
                continue
            b, end = e["data_offsets"]
            out[name] = np.frombuffer(blob[8 + n + b:8 + n + end], _DT[e["dtype"]]).reshape(e["shape"])
    return out


def fp8_round(v: np.ndarray) -> np.ndarray:
    """float64 -> nearest e4m3fn (RNE) after saturating clamp, back to float64."""
    return np.clip(v, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def fp8_other_neighbour(v: float) -> float:
    """The e4m3fn value on the other side of ``v`` from ``fp8_round(v)`` (|v| < 448)."""
    r = float(fp8_round(np.float64(v)))
    code = int(np.array(abs(r), np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    step = 1 if abs(v) > abs(r) else -1  # away from zero when v lies beyond r, else towards it
    other = np.array(code + step, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return float(np.copysign(other, v))


class Reference:
    def __init__(self, directory: str):
        self.cfg = json.load(open(os.path.join(directory, "config.json")))
        q = self.cfg.get("quantization_config") or {}
        hq = os.path.join(directory, "hf_quant_config.json")
        if os.path.exists(hq):
            q = json.load(open(hq))["quantization"]
        self.algo = (q.get("quant_algo") or "").upper() or None
        self.kv = (q.get("kv_cache_quant_algo") or ("FP8" if q.get("kv_cache_scheme") else None))
        self.t = {k: np.asarray(v) for k, v in read_safetensors(directory).items()}
        self.trace: list[tuple[str, np.ndarray]] = []
        # (quantizer name as in trace, position in the row, flat index in that position's values):
        # these elements round to the other neighbouring FP8 code (applies to every row forwarded).
        self.flips: set[tuple[str, int, int]] = set()
        self._float64: dict[str, np.ndarray] = {}
        # MoE: (layer, row) -> the expert ids each token of the row picked [T, k], in order of weight
        self.routes: dict[tuple[int, int], np.ndarray] = {}

    def w(self, name):
        """A stored tensor as float64 (FP8 weights as their raw codes); cached."""
        if name not in self._float64:
            self._float64[name] = self.t[name].astype(np.float64)
        return self._float64[name]

    def quantize(self, name: str, scaled: np.ndarray) -> np.ndarray:
        """FP8 codes (as float64) of ``scaled`` = value / scale, [T, ...] for one row; traced."""
        self.trace.append((name, scaled))
        codes = fp8_round(scaled)
        for (n, pos, j) in self.flips:
            if n == name and pos < scaled.shape[0]:
                flat = codes.reshape(scaled.shape[0], -1)  # a view of codes
                flat[pos, j] = fp8_other_neighbour(scaled.reshape(scaled.shape[0], -1)[pos, j])
        return codes

    def weight(self, prefix):
        """The dequantized weight (codes x weight_scale), float64; cached."""
        if prefix not in self._float64:
            t, w = self.t, self.w(prefix + ".weight")
            if prefix + ".weight_scale" in t and self.algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
                ws = t[prefix + ".weight_scale"].astype(np.float64)
                w = w * (ws if ws.ndim == 0 else ws.reshape(-1, 1))
            elif prefix + ".weight_scale" in t:  # FP8_PB_WO
                ws = t[prefix + ".weight_scale"].astype(np.float64)
                ws = ws.reshape(ws.shape[0], ws.shape[2])
                w = w * np.repeat(np.repeat(ws, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
            self._float64[prefix] = w
        return self._float64[prefix]

    def linear(self, x, prefix):
        t = self.t
        w = self.weight(prefix)
        if prefix + ".weight_scale" in t and self.algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
            if self.algo == "FP8":
                s = float(t[prefix + ".input_scale"])
            else:  # dynamic per-token scale
                s = np.maximum(np.abs(x).max(-1, keepdims=True) / 448.0, 1 / (448 * 512))
            x = self.quantize(prefix, x / s) * s
        y = x @ w.T
        if prefix + ".bias" in t:
            y = y + self.w(prefix + ".bias")
        return y

    def norm(self, x, name):
        eps = self.cfg.get("rms_norm_eps", 1e-6)
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * self.w(name + ".weight")

    def rope(self, x, pos):
        d = x.shape[-1]
        theta = (self.cfg.get("rope_parameters") or {}).get("rope_theta", self.cfg.get("rope_theta", 10000.0))
        inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
        ang = pos[:, None] * inv[None]
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
        rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    def mlp(self, h, p):
        g, u = self.linear(h, p + ".gate_proj"), self.linear(h, p + ".up_proj")
        return self.linear(g / (1 + np.exp(-g)) * u, p + ".down_proj")

    def sparse_layer(self, i: int) -> bool:
        c = self.cfg
        if c["model_type"] == "mixtral":
            return True
        if c["model_type"] != "qwen3_moe":
            return False
        return i not in (c.get("mlp_only_layers") or []) and (i + 1) % (c.get("decoder_sparse_step") or 1) == 0

    def moe(self, h, i: int, row: int):
        """transformers' routing in float64: softmax, top-k (ties: lower id), renormalise; experts summed
        in ascending id order (so is the JAX model's)."""
        c = self.cfg
        mixtral = c["model_type"] == "mixtral"
        block, names = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj",
                                                                                         "down_proj"))
        p = f"model.layers.{i}.{block}"
        logits = h @ self.w(p + ".gate.weight").T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        k = c["num_experts_per_tok"]
        picked = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        weights = np.take_along_axis(probs, picked, -1)
        if mixtral or c.get("norm_topk_prob"):
            weights /= weights.sum(-1, keepdims=True)
        self.routes[(i, row)] = picked
        out = np.zeros_like(h)
        for e in range(probs.shape[-1]):
            tokens = np.nonzero((picked == e).any(-1))[0]
            if len(tokens) == 0:
                continue
            x = f"{p}.experts.{e}"
            g, u = self.linear(h[tokens], f"{x}.{names[0]}"), self.linear(h[tokens], f"{x}.{names[1]}")
            y = self.linear(g / (1 + np.exp(-g)) * u, f"{x}.{names[2]}")
            out[tokens] += y * weights[tokens][picked[tokens] == e][:, None]
        return out

    def forward(self, ids: np.ndarray) -> np.ndarray:
        c = self.cfg
        H, KV = c["num_attention_heads"], c["num_key_value_heads"]
        D = c.get("head_dim") or c["hidden_size"] // H
        window = c.get("sliding_window") if c["model_type"] in ("mistral", "mixtral") else None
        outs = []
        for r, row in enumerate(np.asarray(ids)):
            T = len(row)
            pos = np.arange(T, dtype=np.float64)
            x = self.w("model.embed_tokens.weight")[row]
            for i in range(c["num_hidden_layers"]):
                p = f"model.layers.{i}"
                h = self.norm(x, p + ".input_layernorm")
                q = self.linear(h, p + ".self_attn.q_proj").reshape(T, H, D)
                k = self.linear(h, p + ".self_attn.k_proj").reshape(T, KV, D)
                v = self.linear(h, p + ".self_attn.v_proj").reshape(T, KV, D)
                if p + ".self_attn.q_norm.weight" in self.t:  # Qwen3
                    q, k = self.norm(q, p + ".self_attn.q_norm"), self.norm(k, p + ".self_attn.k_norm")
                q, k = self.rope(q, pos), self.rope(k, pos)
                if self.kv:
                    ks = float(self.t[p + ".self_attn.k_proj.k_scale"])
                    vs = float(self.t[p + ".self_attn.v_proj.v_scale"])
                    k = self.quantize(p + ".k_cache", k / ks) * ks
                    v = self.quantize(p + ".v_cache", v / vs) * vs
                k, v = np.repeat(k, H // KV, 1), np.repeat(v, H // KV, 1)
                s = np.einsum("thd,shd->hts", q, k) / math.sqrt(D)
                visible = np.tril(np.ones((T, T), bool))
                if window is not None:
                    visible &= np.subtract.outer(np.arange(T), np.arange(T)) < window
                s = np.where(visible[None], s, -np.inf)
                s = np.exp(s - s.max(-1, keepdims=True))
                a = np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), v).reshape(T, H * D)
                x = x + self.linear(a, p + ".self_attn.o_proj")
                h = self.norm(x, p + ".post_attention_layernorm")
                x = x + (self.moe(h, i, r) if self.sparse_layer(i) else self.mlp(h, p + ".mlp"))
            x = self.norm(x, "model.norm")
            head = "lm_head.weight" if "lm_head.weight" in self.t else "model.embed_tokens.weight"
            outs.append(x @ self.w(head).T)
        return np.stack(outs)


def midpoint_distance(v: np.ndarray) -> np.ndarray:
    """Distance of each scaled value to the nearest FP8 rounding midpoint (in scaled units)."""
    a = np.minimum(np.abs(v), 448.0)
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -9)))
    e = np.maximum(e, -6)  # subnormal spacing below 2^-6
    ulp = 2.0 ** (e - 3)
    frac = a / ulp - np.floor(a / ulp)
    return np.abs(frac - 0.5) * ulp


def boundary_margin(v: np.ndarray) -> np.ndarray:
    """Relative distance of each scaled value to the nearest FP8 rounding midpoint."""
    return midpoint_distance(v) / np.maximum(np.minimum(np.abs(v), 448.0), 1e-30)


def tie_distance(v: np.ndarray) -> np.ndarray:
    """Distance to the nearest FP8 rounding midpoint relative to max(|value|, RMS of its position).

    ``v`` is [T, ...] (one row, as traced). Relative to the value alone overstates how safe small
    values are: the float32 error of a sum scales with its terms, not with the (possibly cancelled)
    result. Relative to max(|v|, RMS of the values at that position) it is bounded: see TIE_MARGIN.
    """
    flat = np.asarray(v, np.float64).reshape(v.shape[0], -1)
    rms = np.sqrt((flat * flat).mean(-1, keepdims=True))
    return (midpoint_distance(flat) / np.maximum(np.maximum(np.abs(flat), rms), 1e-300)).reshape(v.shape)


# How far from an FP8 rounding midpoint (in tie_distance) a quantizer input may be and still round
# differently in a float32 implementation than in this float64 oracle. Measured: a float32 copy of
# this oracle (numpy; the same FP8 codes forced, so errors do not snowball) differs from it on the
# quantizer inputs of the trained fixtures (~10^5 values per row) by at most 4.9e-6 in these units
# (99.99% below 3e-6; relative to |value| alone the tail reaches 1e-2, on small cancelled sums). The
# package's XLA float32 flipped codes at 2.2e-6 and 2.1e-7. 2e-5 leaves a factor of 4 over the worst
# measured error for other summation orders and CPUs. It only bounds which inputs may be blamed:
# every position is still checked to 1e-3 against the oracle with exactly those inputs flipped.
TIE_MARGIN = 2e-5

_SAME_INPUT = ((".k_proj", ".q_proj"), (".v_proj", ".q_proj"), (".up_proj", ".gate_proj"))


def _input_of(name: str) -> str:
    """q/k/v read one activation, gate/up another: a flip of that input flips it in each of them."""
    for suffix, first in _SAME_INPUT:
        if name.endswith(suffix):
            return name[:-len(suffix)] + first
    return name


def near_ties(trace, upto: int, margin: float = TIE_MARGIN):
    """Quantizer inputs at positions <= ``upto`` within ``margin`` (tie_distance) of an FP8 midpoint.

    Returns [(distance, position, flip)], nearest first; ``flip`` is a frozenset of
    (quantizer, position, index) naming one input element in every quantizer that reads it.
    """
    found: dict[tuple[str, int, int], tuple[float, set]] = {}
    for name, v in trace:
        d = tie_distance(v)[:upto + 1].reshape(min(upto + 1, v.shape[0]), -1)
        for pos, j in zip(*np.nonzero(d < margin)):
            key = (_input_of(name), int(pos), int(j))
            best, names = found.get(key, (np.inf, set()))
            found[key] = (min(best, float(d[pos, j])), names | {name})
    out = [(dist, pos, frozenset((n, pos, j) for n in names)) for (_, pos, j), (dist, names) in found.items()]
    return sorted(out, key=lambda c: (c[0], c[1]))


def explain_by_near_tie_flips(oracle: Reference, row: np.ndarray, got: np.ndarray, tol: float = 1e-3,
                              margin: float = TIE_MARGIN, max_flips: int = 3, max_trials: int = 400):
    """FP8 near-tie flips that make the float64 oracle reproduce ``got`` (logits [T, vocab] of ``row``).

    A float32 implementation may round a quantizer input that lies within float32 error of an FP8
    rounding midpoint to the other neighbouring code; that moves the logits by ~0.01-0.5 from that
    position on. Such a result is still exact -- for the other rounding of that one input. This
    finds those inputs: at the first position p where the oracle differs from ``got`` by more than
    ``tol``, it tries each input at positions <= p within ``margin`` of a midpoint (position p's
    first, nearest first) rounded the other way, alone, and keeps the first that makes every position
    <= p agree to ``tol``; then it goes on from there. Returns the flips (empty when the oracle agrees
    as is); raises AssertionError when no near-tie explains a divergence, or when more than
    ``max_flips`` are needed -- a real error (wrong scale, codes, masking) is not one rounding.
    """
    row = np.asarray(row)
    saved_flips, saved_trace = oracle.flips, oracle.trace
    flips: list[frozenset] = []
    try:
        while True:
            oracle.flips, oracle.trace = set().union(*flips), []
            want = oracle.forward(row[None])[0]
            off = np.flatnonzero(np.abs(want - got).max(-1) > tol)
            if off.size == 0:
                return flips
            p = int(off[0])
            assert len(flips) < max_flips, (
                f"position {p} differs by {np.abs(want[p] - got[p]).max():.3g} after {len(flips)} near-tie flips "
                f"{[sorted(f) for f in flips]}; more than {max_flips} would be needed")
            candidates = near_ties(oracle.trace, p, margin)
            candidates.sort(key=lambda c: c[1] != p)  # stable: position p first, each part nearest first
            for _, _, flip in candidates[:max_trials]:
                oracle.flips, oracle.trace = set().union(*flips, flip), []
                if np.abs(oracle.forward(row[None, :p + 1])[0] - got[:p + 1]).max() <= tol:
                    flips.append(flip)
                    break
            else:
                raise AssertionError(
                    f"position {p} differs from the float64 oracle by {np.abs(want[p] - got[p]).max():.3g} and none "
                    f"of the {min(len(candidates), max_trials)} nearest of {len(candidates)} FP8 near-ties at "
                    f"positions <= {p} (tie_distance < {margin:g}) explains it")
    finally:
        oracle.flips, oracle.trace = saved_flips, saved_trace

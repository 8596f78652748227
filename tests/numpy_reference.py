"""An independent float64 numpy forward of a ModelOpt FP8 Llama/Qwen2 checkpoint (test oracle).

Written separately from the package (own safetensors parsing, no fusion, no JAX) and in float64,
so that it isolates rounding choices: FP8 codes are taken with the same rules, every other op is
exact to float64. ``trace`` collects, for every quantizer, the value divided by its scale, so tests
can see how close an input sits to an FP8 rounding boundary.
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

    def w(self, name):
        return self.t[name].astype(np.float64)

    def linear(self, x, prefix):
        t = self.t
        w = self.w(prefix + ".weight")
        if prefix + ".weight_scale" in t and self.algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
            ws = t[prefix + ".weight_scale"].astype(np.float64)
            if self.algo == "FP8":
                s = float(t[prefix + ".input_scale"])
                self.trace.append((prefix, x / s))
                xq = fp8_round(x / s) * s
            else:
                s = np.maximum(np.abs(x).max(-1, keepdims=True) / 448.0, 1 / (448 * 512))
                self.trace.append((prefix, x / s))
                xq = fp8_round(x / s) * s
            w = w * (ws if ws.ndim == 0 else ws.reshape(-1, 1))
            x = xq
        elif prefix + ".weight_scale" in t:  # FP8_PB_WO
            ws = t[prefix + ".weight_scale"].astype(np.float64)
            ws = ws.reshape(ws.shape[0], ws.shape[2])
            full = np.repeat(np.repeat(ws, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
            w = w * full
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

    def forward(self, ids: np.ndarray) -> np.ndarray:
        c = self.cfg
        H, KV = c["num_attention_heads"], c["num_key_value_heads"]
        D = c.get("head_dim") or c["hidden_size"] // H
        outs = []
        for row in np.asarray(ids):
            T = len(row)
            pos = np.arange(T, dtype=np.float64)
            x = self.w("model.embed_tokens.weight")[row]
            for i in range(c["num_hidden_layers"]):
                p = f"model.layers.{i}"
                h = self.norm(x, p + ".input_layernorm")
                q = self.linear(h, p + ".self_attn.q_proj").reshape(T, H, D)
                k = self.linear(h, p + ".self_attn.k_proj").reshape(T, KV, D)
                v = self.linear(h, p + ".self_attn.v_proj").reshape(T, KV, D)
                q, k = self.rope(q, pos), self.rope(k, pos)
                if self.kv:
                    ks = float(self.t[p + ".self_attn.k_proj.k_scale"])
                    vs = float(self.t[p + ".self_attn.v_proj.v_scale"])
                    self.trace.append((p + ".k_cache", k / ks))
                    self.trace.append((p + ".v_cache", v / vs))
                    k, v = fp8_round(k / ks) * ks, fp8_round(v / vs) * vs
                k, v = np.repeat(k, H // KV, 1), np.repeat(v, H // KV, 1)
                s = np.einsum("thd,shd->hts", q, k) / math.sqrt(D)
                s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
                s = np.exp(s - s.max(-1, keepdims=True))
                a = np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), v).reshape(T, H * D)
                x = x + self.linear(a, p + ".self_attn.o_proj")
                h = self.norm(x, p + ".post_attention_layernorm")
                g, u = self.linear(h, p + ".mlp.gate_proj"), self.linear(h, p + ".mlp.up_proj")
                x = x + self.linear(g / (1 + np.exp(-g)) * u, p + ".mlp.down_proj")
            x = self.norm(x, "model.norm")
            head = "lm_head.weight" if "lm_head.weight" in self.t else "model.embed_tokens.weight"
            outs.append(x @ self.w(head).T)
        return np.stack(outs)


def boundary_margin(v: np.ndarray) -> np.ndarray:
    """Relative distance of each scaled value to the nearest FP8 rounding midpoint."""
    a = np.minimum(np.abs(v), 448.0)
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -9)))
    e = np.maximum(e, -6)  # subnormal spacing below 2^-6
    ulp = 2.0 ** (e - 3)
    frac = a / ulp - np.floor(a / ulp)
    return np.abs(frac - 0.5) * ulp / np.maximum(a, 1e-30)

#!/usr/bin/env python3
"""Measure the replayer's cost-model constants on one GPU and write a profile (standalone script).

Needs only the standard library, torch and transformers: no sglang, no network (the model is a
random-weight Qwen2.5-3B-shaped ``Qwen2ForCausalLM`` built from a config), and it does not import
``sgl_agentcache``, so it runs on a bare GPU machine. It measures, in this order:

1. host<->device copy bandwidth (h2d, d2h) for pinned and pageable host memory, at KV block sizes
   (16..4096 tokens of KV), alone and while a matmul loop runs on another CUDA stream;
2. prefill tokens/s (batch 1, no prefix) at several context lengths;
3. decode seconds/token at a moderate context, with a KV cache.

Writes ``<out>/<tag>.json`` (schema ``sgl-agentcache-profile/1``, read by
``sgl_agentcache.policy.profiles.load_profile``) and ``<out>/<tag>.raw.json`` (every measurement), then prints
a summary. The raw file is rewritten after each section, so a run cut short keeps what it measured.

Time: a global budget (``--budget-s``, default 420 s, imports included) with per-section and
per-measurement caps; a measurement that would not fit is skipped and listed in ``skipped``. As a last
resort, faulthandler kills the process 45 s past the budget, so a hung kernel cannot overrun an 8-minute
slot. Exit status: 0 when the profile was written, 2 when a constant could not be measured (raw only).

``--dry-run`` runs every code path with tiny sizes (tiny model, tiny blocks, 2 reps) on whatever device
is present, in seconds; without CUDA, pinned memory and streams do not exist, so pinned cells are
recorded as skipped and "concurrent" compute runs before the copy (labelled ``sequential``).
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # the budget counts from here: importing torch and transformers takes seconds

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

PROFILE_SCHEMA = "sgl-agentcache-profile/1"
RAW_SCHEMA = "sgl-agentcache-calibration-raw/1"

#: Qwen2.5-3B's shape (its config.json); KV per token = 36 layers * 2 (k,v) * 2 kv heads * 128 * 2 B = 36 KiB.
QWEN25_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True)


class Plan:
    """Every size and cap of one run: the full H200 plan, or the tiny dry-run plan."""

    def __init__(self, dry_run: bool):
        def pick(dry, full):
            return dry if dry_run else full

        self.dry_run = dry_run
        self.model = pick(TINY, QWEN25_3B)
        self.block_tokens = pick([1, 4], [16, 64, 256, 1024, 4096])
        self.matmul_n = pick(64, 8192)
        # warmups, timed reps, cap per measurement (s), cap per section (s)
        self.bw_warmup, self.bw_reps, self.bw_cell_s, self.bw_section_s = pick((1, 2, 2.0, 10.0), (3, 25, 4.0, 100.0))
        self.prefill_lengths = pick([16, 64], [512, 2048, 4096, 8192, 16384])
        self.prefill_warmup, self.prefill_reps, self.prefill_len_s, self.prefill_section_s = pick(
            (1, 2, 5.0, 20.0), (1, 5, 30.0, 150.0))
        self.representative_context = pick(64, 4096)  # the prefill constant's length and the decode context
        self.decode_chunks, self.decode_chunk_steps, self.decode_section_s = pick((2, 2, 10.0), (6, 16, 60.0))


class Budget:
    """The global deadline; sections and measurements take ``min(own cap, time left)``."""

    def __init__(self, total_s: float):
        self.deadline = T0 + total_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def cap(self, own_s: float) -> float:
        return max(0.0, min(own_s, self.left()))


def summarize(xs: list[float]) -> dict:
    """n, median, p10, p90, min, max of samples (p10/p90 inclusive-quantile; equal to the sample when n=1)."""
    xs = sorted(xs)
    if len(xs) >= 2:
        q = statistics.quantiles(xs, n=10, method="inclusive")
        p10, p90 = q[0], q[-1]
    else:
        p10 = p90 = xs[0]
    return {"n": len(xs), "median": statistics.median(xs), "p10": p10, "p90": p90, "min": xs[0], "max": xs[-1]}


def repeat(fn, *, warmup: int, reps: int, cap_s: float) -> list:
    """Call ``fn`` ``warmup`` times untimed, then up to ``reps`` times collecting its results.

    Stops early once ``cap_s`` seconds have passed since the first call (warmup included), so one slow
    measurement cannot eat the global budget; returns what it collected (possibly nothing).
    """
    start = time.monotonic()
    for _ in range(warmup):
        if time.monotonic() - start >= cap_s:
            return []
        fn()
    out = []
    while len(out) < reps and time.monotonic() - start < cap_s:
        out.append(fn())
    return out


class Gpu:
    """CUDA streams and timing events, or host stand-ins on CPU (where every op is synchronous)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def stream(self):
        return torch.cuda.Stream(self.device) if self.cuda else None

    def on(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def event(self):
        return torch.cuda.Event(enable_timing=True) if self.cuda else _HostEvent()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)


class _HostEvent:
    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other: _HostEvent) -> float:  # milliseconds, like torch.cuda.Event
        return (other.t - self.t) * 1e3


# ---------------------------------------------------------------------------------------------------
# 1. host <-> device bandwidth


def measure_bandwidth(gpu: Gpu, plan: Plan, kv_bytes_per_token: int, budget: Budget, skipped: list) -> dict:
    """One cell per (direction, host memory, compute, block size): copy time and effective bytes/s.

    ``seconds`` is wall clock from issuing the copy to its completion (stream synchronized before),
    so it includes launch and sync overhead, as a real offload/reload pays; ``gpu_seconds`` is the
    copy stream's own event-to-event time. Under ``concurrent`` compute, a backlog of matmuls sized
    to outlast the copy is queued on another stream first; ``overlap_fraction`` is the share of reps
    in which that compute really spanned the whole copy.
    """
    section_end = time.monotonic() + budget.cap(plan.bw_section_s)
    copy_stream, compute_stream = gpu.stream(), gpu.stream()
    dtype = torch.bfloat16 if gpu.cuda else torch.float32
    a = torch.randn(plan.matmul_n, plan.matmul_n, device=gpu.device, dtype=dtype)
    b, c = torch.randn_like(a), torch.empty_like(a)

    def matmuls(n: int):
        with gpu.on(compute_stream):
            for _ in range(n):
                torch.matmul(a, b, out=c)

    matmuls(2)  # warm up: the first matmul pays cuBLAS handle creation and heuristics
    gpu.sync()
    t = time.perf_counter()
    matmuls(10)
    gpu.sync()
    matmul_s = max((time.perf_counter() - t) / 10, 1e-6)
    memories = ["pinned", "pageable"] if gpu.cuda else ["pageable"]
    if not gpu.cuda:
        skipped.append({"what": "bandwidth/pinned", "why": "no CUDA: host memory cannot be pinned"})
    cells = []
    for tokens in plan.block_tokens:
        nbytes = tokens * kv_bytes_per_token
        dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=gpu.device)
        for memory in memories:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=(memory == "pinned"))
            host.fill_(1)  # touch every page: first-touch faults are not the copy's cost
            dev_buf.fill_(1)
            for direction in ("h2d", "d2h"):
                dst, src = (dev_buf, host) if direction == "h2d" else (host, dev_buf)
                alone_s = None
                for compute in ("alone", "concurrent"):
                    what = f"bandwidth/{direction}/{memory}/{compute}/{tokens}tok"
                    cap = min(plan.bw_cell_s, section_end - time.monotonic(), budget.left())
                    if cap <= 0:
                        skipped.append({"what": what, "why": "time budget"})
                        continue
                    backlog = 0
                    if compute == "concurrent":
                        # Enough matmuls to keep the compute stream busy for ~2x the lone copy (min 2).
                        backlog = min(2000, 2 + math.ceil(2 * (alone_s or matmul_s) / matmul_s))

                    def one():
                        gpu.sync()
                        c0, c1, k0, k1 = gpu.event(), gpu.event(), gpu.event(), gpu.event()
                        if backlog:
                            k0.record(compute_stream)
                            matmuls(backlog)
                            k1.record(compute_stream)
                        t0 = time.perf_counter()
                        with gpu.on(copy_stream):
                            c0.record(copy_stream)
                            dst.copy_(src, non_blocking=True)
                            c1.record(copy_stream)
                        c1.synchronize()
                        wall = time.perf_counter() - t0
                        gpu.sync()  # drain the compute backlog before the next rep
                        # Compute spanned the copy: it started before the copy and ended after it.
                        overlapped = (bool(backlog) and gpu.cuda
                                      and k0.elapsed_time(c0) >= 0 and c1.elapsed_time(k1) >= 0)
                        return wall, c0.elapsed_time(c1) / 1e3, overlapped

                    samples = repeat(one, warmup=plan.bw_warmup, reps=plan.bw_reps, cap_s=cap)
                    if not samples:
                        skipped.append({"what": what, "why": "time budget"})
                        continue
                    secs = summarize([s[0] for s in samples])
                    if compute == "alone":
                        alone_s = secs["median"]
                    cells.append({
                        "direction": direction, "memory": memory, "tokens": tokens, "bytes": nbytes,
                        "compute": compute if gpu.cuda or compute == "alone" else "sequential",
                        "matmul_backlog": backlog, "seconds": secs,
                        "gpu_seconds": summarize([s[1] for s in samples]),
                        # p10 of bandwidth is the slow tail: bytes over the p90 time.
                        "bytes_per_s": {"median": nbytes / secs["median"], "p10": nbytes / secs["p90"],
                                        "p90": nbytes / secs["p10"]},
                        "overlap_fraction": (sum(s[2] for s in samples) / len(samples)
                                             if backlog and gpu.cuda else None),
                    })
            del host
        del dev_buf
    return {"matmul": {"n": plan.matmul_n, "dtype": str(dtype), "seconds": matmul_s},
            "concurrency": "cuda-streams" if gpu.cuda else "sequential (no CUDA streams)", "cells": cells}


# ---------------------------------------------------------------------------------------------------
# 2-3. prefill and decode of a random-weight Qwen2.5-3B-shaped model


def build_model(plan: Plan, device: torch.device, dtype: torch.dtype):
    """A random-weight Qwen2ForCausalLM of the plan's shape, built directly on ``device`` (no download)."""
    import transformers

    cfg = transformers.Qwen2Config(**plan.model, attn_implementation="sdpa")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # version-neutral: from_config's dtype kwarg was renamed in transformers 5
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.to(device=device, dtype=dtype).eval()


def _last_logits(model, ids, past=None, use_cache=False):
    # Run the decoder, then the LM head on the last position only (as a server does): full-sequence
    # logits at 16K tokens x 152K vocab would cost GBs and time no server spends.
    out = model.model(input_ids=ids, past_key_values=past, use_cache=use_cache)
    return model.lm_head(out.last_hidden_state[:, -1:]), out.past_key_values


def measure_prefill(model, gpu: Gpu, plan: Plan, vocab: int, budget: Budget, skipped: list) -> list:
    """Per context length: wall seconds of one batch-1 prefill (no prefix), and tokens/s.

    A length is skipped when the previous one, scaled superlinearly (attention), predicts it will not
    fit in what is left of the section, or when it runs out of memory.
    """
    section_end = time.monotonic() + budget.cap(plan.prefill_section_s)
    rows, prev = [], None
    for length in plan.prefill_lengths:
        what = f"prefill/{length}"
        left = min(section_end - time.monotonic(), budget.left())
        if prev is not None:
            predicted = prev[1] * (length / prev[0]) ** 1.5 * (plan.prefill_warmup + 1)
            if predicted > left:
                skipped.append({"what": what, "why": f"time budget (predicted {predicted:.1f}s > {left:.1f}s left)"})
                continue
        if left <= 0:
            skipped.append({"what": what, "why": "time budget"})
            continue
        ids = torch.randint(3, vocab, (1, length), device=gpu.device)

        def one():
            gpu.sync()
            t0 = time.perf_counter()
            with torch.inference_mode():
                logits, _ = _last_logits(model, ids)
                logits.argmax(-1)
            gpu.sync()
            return time.perf_counter() - t0

        try:
            samples = repeat(one, warmup=plan.prefill_warmup, reps=plan.prefill_reps,
                             cap_s=min(plan.prefill_len_s, left))
        except torch.cuda.OutOfMemoryError:
            skipped.append({"what": what, "why": "out of memory"})
            torch.cuda.empty_cache()
            continue
        if not samples:
            skipped.append({"what": what, "why": "time budget"})
            continue
        secs = summarize(samples)
        prev = (length, secs["median"])
        rows.append({"context_tokens": length, "seconds": secs, "tokens_per_s": length / secs["median"]})
    return rows


def measure_decode(model, gpu: Gpu, plan: Plan, vocab: int, budget: Budget, skipped: list) -> dict | None:
    """Greedy decode after a prefill of ``representative_context`` tokens, with the HF KV cache.

    Timed in chunks of ``decode_chunk_steps`` steps (sync at chunk ends only, as a server loop would);
    the sample is seconds per token of one chunk.
    """
    cap = budget.cap(plan.decode_section_s)
    ctx = plan.representative_context
    if cap <= 0:
        skipped.append({"what": f"decode/{ctx}", "why": "time budget"})
        return None
    start = time.monotonic()
    ids = torch.randint(3, vocab, (1, ctx), device=gpu.device)
    try:
        with torch.inference_mode():
            logits, past = _last_logits(model, ids, use_cache=True)  # the model makes its own cache type
            state = {"tok": logits.argmax(-1), "past": past}

            def chunk():
                gpu.sync()
                t0 = time.perf_counter()
                for _ in range(plan.decode_chunk_steps):
                    logits, state["past"] = _last_logits(model, state["tok"], past=state["past"], use_cache=True)
                    state["tok"] = logits.argmax(-1)
                gpu.sync()
                return (time.perf_counter() - t0) / plan.decode_chunk_steps

            samples = repeat(chunk, warmup=1, reps=plan.decode_chunks, cap_s=cap - (time.monotonic() - start))
    except torch.cuda.OutOfMemoryError:
        skipped.append({"what": f"decode/{ctx}", "why": "out of memory"})
        return None
    if not samples:
        skipped.append({"what": f"decode/{ctx}", "why": "time budget"})
        return None
    return {"context_tokens": ctx, "chunk_steps": plan.decode_chunk_steps, "s_per_token": summarize(samples)}


# ---------------------------------------------------------------------------------------------------
# profile


def pick_constants(raw: dict, plan: Plan) -> tuple[dict, dict]:
    """Choose the profile's constants from the raw measurements; returns (constants, their sources).

    - prefill: tokens/s at ``representative_context`` (4096), else the nearest measured length (log scale);
    - decode: median s/token at that context;
    - h2d/d2h: median effective (wall-clock) bandwidth at the largest measured block, preferring pinned
      memory under concurrent compute (what an offload/reload during serving sees), then pinned alone,
      then pageable. A constant that was not measured is left out.
    """
    consts, sources = {}, {}
    rows = raw.get("prefill") or []
    if rows:
        row = min(rows, key=lambda r: abs(math.log(r["context_tokens"] / plan.representative_context)))
        consts["prefill_tokens_per_s"] = row["tokens_per_s"]
        sources["prefill_tokens_per_s"] = (f"prefill, batch 1, no prefix, {row['context_tokens']}-token context, "
                                           f"median of {row['seconds']['n']}")
    dec = raw.get("decode")
    if dec:
        consts["decode_s_per_token"] = dec["s_per_token"]["median"]
        sources["decode_s_per_token"] = (f"HF eager greedy decode at {dec['context_tokens']}-token context, "
                                         f"median of {dec['s_per_token']['n']} chunks of {dec['chunk_steps']} steps")
    cells = (raw.get("bandwidth") or {}).get("cells", [])
    for direction in ("h2d", "d2h"):
        for memory, compute in (("pinned", "concurrent"), ("pinned", "alone"), ("pageable", "concurrent"),
                                ("pageable", "sequential"), ("pageable", "alone")):
            found = [c for c in cells if (c["direction"], c["memory"], c["compute"]) == (direction, memory, compute)]
            if found:
                cell = max(found, key=lambda c: c["tokens"])
                consts[f"{direction}_bytes_per_s"] = cell["bytes_per_s"]["median"]
                sources[f"{direction}_bytes_per_s"] = (
                    f"{memory} host memory, compute {compute}, {cell['tokens']}-token block ({cell['bytes']} B), "
                    f"median wall-clock of {cell['seconds']['n']}")
                break
    return consts, sources


def slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'cpu' -> 'cpu'."""
    name = re.sub(r"^nvidia\s+", "", name.lower())
    return re.sub(r"[^a-z0-9.]+", "-", name).strip("-") or "device"


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)  # atomic: a killed run never leaves half a file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output directory")
    ap.add_argument("--tag", help="file stem (default: device slug, e.g. h200; 'dryrun' with --dry-run)")
    ap.add_argument("--name", help="profile name (default: qwen2.5-3b-<device slug>-calibrated)")
    ap.add_argument("--budget-s", type=float, help="global time budget, imports included (default 420; 40 dry)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, every code path, any device, seconds")
    ap.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    args = ap.parse_args(argv)

    plan = Plan(args.dry_run)
    budget = Budget(args.budget_s if args.budget_s is not None else (40.0 if args.dry_run else 420.0))
    faulthandler.dump_traceback_later(max(1.0, budget.left() + 45.0), exit=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = Gpu(device)
    torch.manual_seed(0)
    dev_name = torch.cuda.get_device_name(device) if gpu.cuda else platform.processor() or "cpu"
    dev_slug = "cpu" if not gpu.cuda else slug(dev_name)
    tag = args.tag or ("dryrun" if args.dry_run else dev_slug)
    name = args.name or (f"dryrun-tiny-{dev_slug}" if args.dry_run else f"qwen2.5-3b-{dev_slug}-calibrated")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile_path, raw_path = out / f"{tag}.json", out / f"{tag}.raw.json"

    # KV on the wire is in the serving dtype: bf16 on GPU; the CPU dry run computes in fp32.
    dtype = torch.bfloat16 if gpu.cuda else torch.float32
    m = plan.model
    head_dim = m["hidden_size"] // m["num_attention_heads"]
    kv_bytes_per_token = m["num_hidden_layers"] * 2 * m["num_key_value_heads"] * head_dim * torch.finfo(dtype).bits // 8
    import transformers

    env = {"device": dev_name, "device_type": device.type, "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "dry_run": args.dry_run,
           "gpu_memory_bytes": torch.cuda.get_device_properties(device).total_memory if gpu.cuda else None,
           "cpu_count": os.cpu_count()}
    skipped: list[dict] = []
    raw = {"schema": RAW_SCHEMA, "env": env, "budget_s": budget.deadline - T0,
           "model": {**m, "dtype": str(dtype), "kv_bytes_per_token": kv_bytes_per_token},
           "bandwidth": None, "prefill": None, "decode": None, "skipped": skipped}

    def checkpoint():
        raw["elapsed_s"] = time.monotonic() - T0
        write_json(raw_path, raw)

    raw["bandwidth"] = measure_bandwidth(gpu, plan, kv_bytes_per_token, budget, skipped)
    checkpoint()
    if budget.left() > 0:
        model_t0 = time.monotonic()
        model = build_model(plan, device, dtype)
        raw["model"].update(build_s=time.monotonic() - model_t0, param_dtype=str(next(model.parameters()).dtype),
                            attn_implementation=getattr(model.config, "_attn_implementation", None))
        raw["prefill"] = measure_prefill(model, gpu, plan, m["vocab_size"], budget, skipped)
        checkpoint()
        raw["decode"] = measure_decode(model, gpu, plan, m["vocab_size"], budget, skipped)
        del model
    else:
        skipped.append({"what": "model (prefill, decode)", "why": "time budget"})
    checkpoint()

    consts, sources = pick_constants(raw, plan)
    print_summary(raw, consts)
    needed = ("prefill_tokens_per_s", "decode_s_per_token", "h2d_bytes_per_s", "d2h_bytes_per_s")
    missing = [k for k in needed if k not in consts]
    if missing:
        print(f"NOT writing {profile_path}: not measured: {', '.join(missing)} (see {raw_path})", file=sys.stderr)
        return 2
    profile = {"schema": PROFILE_SCHEMA, "name": name, "kv_bytes_per_token": kv_bytes_per_token, **consts,
               "measured": {**{k: env[k] for k in ("device", "torch", "transformers", "cuda", "date", "dry_run")},
                            "model": "random-weight Qwen2.5-3B shape" if not args.dry_run else "tiny dry-run model",
                            "dtype": str(dtype), "raw_file": raw_path.name,
                            "kv_bytes_per_token": (f"{m['num_hidden_layers']} layers x 2 (k,v) x "
                                                   f"{m['num_key_value_heads']} kv heads x {head_dim} head dim x "
                                                   f"{torch.finfo(dtype).bits // 8} B"),
                            "sources": sources}}
    write_json(profile_path, profile)
    print(f"wrote {profile_path} and {raw_path} in {time.monotonic() - T0:.1f}s")
    return 0


def print_summary(raw: dict, consts: dict) -> None:
    gib = 2**30
    print(f"\n== {raw['env']['device']} | torch {raw['env']['torch']} | dry_run={raw['env']['dry_run']}")
    print(f"{'copy':<30}{'tokens':>8}{'MiB':>9}{'GiB/s p10':>11}{'median':>9}{'p90':>8}{'overlap':>9}")
    for c in (raw["bandwidth"] or {}).get("cells", []):
        bw = c["bytes_per_s"]
        ov = "-" if c["overlap_fraction"] is None else f"{c['overlap_fraction']:.2f}"
        print(f"{c['direction'] + ' ' + c['memory'] + ' ' + c['compute']:<30}{c['tokens']:>8}{c['bytes'] / 2**20:>9.2f}"
              f"{bw['p10'] / gib:>11.2f}{bw['median'] / gib:>9.2f}{bw['p90'] / gib:>8.2f}{ov:>9}")
    print(f"{'prefill context':<30}{'tok/s median':>14}{'s median':>11}")
    for r in raw["prefill"] or []:
        print(f"{r['context_tokens']:<30}{r['tokens_per_s']:>14.0f}{r['seconds']['median']:>11.4f}")
    if raw["decode"]:
        d = raw["decode"]["s_per_token"]
        print(f"decode @ {raw['decode']['context_tokens']} tokens: {d['median'] * 1e3:.2f} ms/token "
              f"(p10 {d['p10'] * 1e3:.2f}, p90 {d['p90'] * 1e3:.2f})")
    for s in raw["skipped"]:
        print(f"skipped {s['what']}: {s['why']}")
    print("profile constants:", json.dumps(consts))


if __name__ == "__main__":
    sys.exit(main())

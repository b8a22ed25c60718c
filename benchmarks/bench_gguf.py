"""rtpcore on GGUF files against llama.cpp on the same files, in the same run (docs/design.md §20).

    python benchmarks/bench_gguf.py [--llamacpp DIR] [--types f32,q8_0,q4_k_m] [--new-tokens 64]
        [--cpu-isa avx2|avx512|avx512_bf16|amx]

The model is SmolLM2-135M's shape with seeded random weights and a SentencePiece tokenizer
(benchmarks/_smollm2.py), converted by llama.cpp's own converter and quantizer:
``../shared/tools/setup_llamacpp.sh DIR CKPT`` (run here when DIR has no files yet; ~15 min the
first time) builds llama-cpp-python from its sdist with this CPU's flags, ``llama-bench``,
``llama-server`` and ``llama-quantize``, and writes DIR/smollm2-135m-{f32,f16,bf16,q8_0,q4_k_m,q6_k}.gguf.

Rows, per file, each engine in a process of its own (two thread pools in one process halve
either's speed), 2 threads each:

* decode: batch-1 tokens per second after a 16-token prompt (rtpcore: (time of N+1 new tokens -
  time of 1) / N; llama.cpp: the better of ``llama-bench``'s tg and llama-cpp-python's generate loop);
* prefill: a 512-token prompt's tokens per second (llama-bench pp512);
* batch 8: aggregate decode tokens per second of 8 prompts at once (llama-server, 8 slots,
  continuous batching, 8 concurrent /completion requests);
* memory: the resident set after loading and generating (steady: VmRSS, its file-backed part
  RssFile -- a GGUF file's mapped pages -- beside it) and its peak (VmHWM); and the load time
  (``Engine.from_pretrained`` / ``Llama(...)``, the libraries already imported).

``--load-only`` measures only the load and the memory (after a 4-token generation, so the weights
are paged in), in a few seconds a file.

Each rtpcore figure is printed with the kernel that ran most of its steps (the
``engine.stats().kernel_calls`` key: ``native_decode[avx512_vnni]``, ``torch_step[native:amx]``,
``torch_step[torch (float32 GEMM)]``; ``rtpcore info`` explains them). ``--cpu-isa`` caps
rtpcore's child processes as on a CPU of that class (``RTPCORE_CPU_ISA``, set before torch runs).

``--cpu-time`` measures instead one thread per engine in CPU time per token (rtpcore's process time
around its generate calls; llama-bench's rusage, the difference between runs of 1 and 1 + R
repetitions), which other processes on a shared machine do not inflate: decode (tg) and prefill
(pp512), rtpcore / llama.cpp as speed ratios.

Plus rtpcore's float32 safetensors checkpoint (the same weights) against llama.cpp's F32 file when
f32 is among the types, and the same checkpoint with rtpcore's own int8 weights
(``quantization="int8"``) against llama.cpp's Q8_0 file when q8_0 is.
The ratios are rtpcore / llama.cpp (above 1: rtpcore is faster, or for memory uses more). The CPU
and its features are printed first: figures from one CPU kind do not carry to another.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SETUP = ROOT.parent / "shared" / "tools" / "setup_llamacpp.sh"
THREADS = 2
PROMPT = 16  # tokens before a decode measurement
PREFILL = 512
BATCH = 8
# rtpcore's KV pool: 48 MiB, 1088 tokens of float32 keys and values (max_model_len 1024), room for
# the batch rows and the prefill prompt with their new tokens (the CPU default, max_batch_size
# sequences of max_model_len tokens up to a quarter of the memory, would measure the pool, not the
# model). llama.cpp's: n_ctx 2048 of float16 (llama-cpp-python, 47 MiB), 8 x 256 (llama-server).
KV_BYTES = 48 << 20

# ---- rtpcore, in a child process -------------------------------------------------------------

MEMORY = r"""
def memory():
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    mib = lambda key: int(status[key].split()[0]) / 1024
    return {"rss_mib": mib("VmRSS"), "peak_mib": mib("VmHWM"), "file_mib": mib("RssFile"), "anon_mib": mib("RssAnon")}
"""

RTPCORE_CHILD = MEMORY + r"""
import json, os, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from rtpcore import Engine, SamplingParams
spec = json.loads(sys.argv[1])
t = time.perf_counter()
engine = Engine.from_pretrained(spec["path"], max_model_len=1024, enable_prefix_caching=False,
                                max_num_batched_tokens=1024, max_batch_size=spec["batch"],
                                kv_cache_memory=spec["kv_bytes"], **spec.get("options", {}))
load = time.perf_counter() - t
def prompt(n, salt):
    return [3 + (97 * i + 31 * salt) % 7000 for i in range(n)]
def run(prompts, new):
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    engine.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - t
def busiest(before):  # the kernel_calls key that ran the most steps since `before`
    after = engine.stats().kernel_calls
    delta = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
    return max(delta, key=delta.get) if delta else "-"
new = spec["new"]
out = {"load_s": load, "loaded": memory()}
one = [prompt(spec["prompt"], 0)]
run(one, 4)  # warm-up
if spec.get("load_only"):
    print(json.dumps({**out, **memory()}))
    engine.close()
    sys.exit(0)
best = lambda f: min(f() for _ in range(spec["repeats"]))
t1 = best(lambda: run(one, 1)); before = engine.stats().kernel_calls; tn = best(lambda: run(one, new + 1))
out["decode_tps"] = new / max(tn - t1, 1e-9)
out["decode_kernel"] = busiest(before)
long = [prompt(spec["prefill"], 1)]
before = engine.stats().kernel_calls
out["prefill_tps"] = spec["prefill"] / best(lambda: run(long, 1))
out["prefill_kernel"] = busiest(before)
batch = [prompt(spec["prompt"], s) for s in range(spec["batch"])]
b1 = best(lambda: run(batch, 1)); before = engine.stats().kernel_calls; bn = best(lambda: run(batch, new + 1))
out["batch_tps"] = spec["batch"] * new / max(bn - b1, 1e-9)
out["batch_kernel"] = busiest(before)
kernels = {getattr(m, "kernel", None) for m in engine.model.modules()} - {None}
out["kernels"] = sorted(kernels)
out["attention_calls"] = dict(engine.stats().attention_calls)  # native_cpu: the native decode step
out.update(memory())
engine.close()
print(json.dumps(out))
"""


def rtpcore_row(path: Path, new: int, repeats: int, cpu_isa: str | None = None, load_only: bool = False,
                **options: Any) -> dict[str, Any]:
    spec = {"path": str(path), "new": new, "prompt": PROMPT, "prefill": PREFILL, "batch": BATCH,
            "repeats": repeats, "options": options, "kv_bytes": KV_BYTES, "load_only": load_only}
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    if cpu_isa is not None:  # in the environment: the child caps torch before its first product
        env["RTPCORE_CPU_ISA"] = cpu_isa
    proc = subprocess.run([sys.executable, "-c", RTPCORE_CHILD, json.dumps(spec), str(THREADS)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"rtpcore on {path.name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


RTPCORE_CPU_CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from rtpcore import Engine, SamplingParams
spec = json.loads(sys.argv[1])
engine = Engine.from_pretrained(spec["path"], max_model_len=1024, enable_prefix_caching=False,
                                max_num_batched_tokens=1024, max_batch_size=1, kv_cache_memory=spec["kv_bytes"],
                                **spec.get("options", {}))
def prompt(n, salt):
    return [3 + (97 * i + 31 * salt) % 7000 for i in range(n)]
def cpu(prompts, new):
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t = time.process_time()
    engine.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.process_time() - t
one, long = [prompt(spec["prompt"], 0)], [prompt(spec["prefill"], 1)]
cpu(one, 4)
cpu(long, 1)
best = lambda f: min(f() for _ in range(spec["repeats"]))
out = {"decode_ms": 1e3 * best(lambda: cpu(one, spec["new"] + 1) - cpu(one, 1)) / spec["new"],
       "prefill_ms": 1e3 * best(lambda: cpu(long, 1)) / spec["prefill"]}
engine.close()
print(json.dumps(out))
"""


def rtpcore_cpu_row(path: Path, new: int, repeats: int, **options: Any) -> dict[str, Any]:
    """One thread: rtpcore's CPU milliseconds per decoded and per prefilled token."""
    spec = {"path": str(path), "new": new, "prompt": PROMPT, "prefill": PREFILL, "repeats": repeats,
            "options": options, "kv_bytes": KV_BYTES}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RTPCORE_CPU_CHILD, json.dumps(spec)], capture_output=True,
                          text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"rtpcore on {path.name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- llama.cpp -------------------------------------------------------------------------------


def llama_bench_cpu(llamacpp: Path, gguf: Path, new: int, repeats: int) -> dict[str, float]:
    """One thread: llama.cpp's CPU milliseconds per decoded and per prefilled token, from
    llama-bench's rusage (runs of 1 + repeats repetitions less runs of 1: load and warm-up cancel)."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(llamacpp / "build" / "bin")}

    def cpu(args: list[str], reps: int) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([str(llamacpp / "bin" / "llama-bench"), "-m", str(gguf), "-t", "1", *args, "-r", str(reps),
                        "-o", "json"], capture_output=True, text=True, env=env, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime

    tg, pp = ["-p", "0", "-n", str(new)], ["-p", str(PREFILL), "-n", "0"]
    return {"decode_ms": 1e3 * (cpu(tg, 1 + repeats) - cpu(tg, 1)) / repeats / new,
            "prefill_ms": 1e3 * (cpu(pp, 1 + repeats) - cpu(pp, 1)) / repeats / PREFILL}


def cpu_time_run(args: argparse.Namespace, ckpt: Path, name: str) -> None:
    """--cpu-time: one thread per engine, CPU time per token, each file and the int8 row."""
    print("one thread per engine, CPU ms per token (speed ratio rtpcore / llama.cpp)")
    print("\n| file | decode ms/token rtpcore / llama.cpp | prefill 512 ms/token |")
    print("|---|---|---|")
    rows = [(t, args.llamacpp / f"{name}-{t}.gguf", args.llamacpp / f"{name}-{t}.gguf", {}) for t in args.types.split(",")]
    if "q8_0" in args.types.split(","):
        rows.append(("int8 (safetensors) vs Q8_0", args.llamacpp / f"{name}-q8_0.gguf", ckpt,
                     {"dtype": "float32", "quantization": "int8"}))
    for label, gguf, ours_path, options in rows:
        ours = rtpcore_cpu_row(ours_path, args.new_tokens, args.repeats, **options)
        peer = llama_bench_cpu(args.llamacpp, gguf, args.new_tokens, args.repeats)
        print(f"| {label} | {ours['decode_ms']:.2f} / {peer['decode_ms']:.2f} ({peer['decode_ms'] / ours['decode_ms']:.2f}x) | "
              f"{ours['prefill_ms']:.3f} / {peer['prefill_ms']:.3f} ({peer['prefill_ms'] / ours['prefill_ms']:.2f}x) |",
              flush=True)


LLAMA_CPP_PYTHON_CHILD = MEMORY + r"""
import json, sys, time
from llama_cpp import Llama
spec = json.loads(sys.argv[1])
t = time.perf_counter()
llm = Llama(model_path=spec["path"], n_threads=spec["threads"], n_threads_batch=spec["threads"], n_ctx=2048,
            n_batch=512, verbose=False)
load = time.perf_counter() - t
prompt = [3 + (97 * i) % 7000 for i in range(spec["prompt"])]
def gen(n):
    llm.reset()
    t = time.perf_counter()
    count = 0
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        count += 1
        if count == n:
            break
    return time.perf_counter() - t
gen(4)
if spec.get("load_only"):
    print(json.dumps({"load_s": load, **memory()}))
    sys.exit(0)
t1 = min(gen(1) for _ in range(spec["repeats"])); tn = min(gen(spec["new"] + 1) for _ in range(spec["repeats"]))
print(json.dumps({"decode_tps": spec["new"] / (tn - t1), "load_s": load, **memory()}))
"""


def llama_bench(llamacpp: Path, gguf: Path, new: int) -> dict[str, float]:
    proc = subprocess.run([str(llamacpp / "bin" / "llama-bench"), "-m", str(gguf), "-t", str(THREADS),
                           "-p", str(PREFILL), "-n", str(new), "-r", "3", "-o", "json"],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {}
    out = {}
    for row in json.loads(proc.stdout):
        if row.get("n_prompt") == PREFILL and not row.get("n_gen"):
            out["prefill_tps"] = row["avg_ts"]
        elif row.get("n_gen") == new and not row.get("n_prompt"):
            out["decode_tps"] = row["avg_ts"]
    return out


def llama_cpp_python(llamacpp: Path, gguf: Path, new: int, repeats: int, load_only: bool = False) -> dict[str, Any]:
    python = llamacpp / "venv" / "bin" / "python"
    spec = {"path": str(gguf), "threads": THREADS, "prompt": PROMPT, "new": new, "repeats": repeats,
            "load_only": load_only}
    proc = subprocess.run([str(python), "-c", LLAMA_CPP_PYTHON_CHILD, json.dumps(spec)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr[-500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server_batch(llamacpp: Path, gguf: Path, new: int) -> dict[str, Any]:
    """Aggregate decode tok/s of BATCH concurrent requests on llama-server (BATCH slots)."""
    port = _free_port()
    server = subprocess.Popen([str(llamacpp / "bin" / "llama-server"), "-m", str(gguf), "-t", str(THREADS),
                               "-np", str(BATCH), "-c", str(BATCH * 256), "--port", str(port), "--host", "127.0.0.1",
                               "-cb"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)

        def one(salt: int, n: int, out: list[float]) -> None:
            prompt = [3 + (97 * i + 31 * salt) % 7000 for i in range(PROMPT)]
            body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True,
                               "cache_prompt": False}).encode()
            req = urllib.request.Request(f"{base}/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                json.loads(r.read())
            out.append(time.perf_counter())

        def wave(n: int) -> float:
            ends: list[float] = []
            threads = [threading.Thread(target=one, args=(s, n, ends)) for s in range(BATCH)]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            return max(ends) - t

        wave(2)
        t1 = min(wave(1) for _ in range(2))
        tn = min(wave(new + 1) for _ in range(2))
        with open(f"/proc/{server.pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return {"batch_tps": BATCH * new / (tn - t1), "rss_mib": int(status["VmHWM"].split()[0]) / 1024}
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


# ---- the run ---------------------------------------------------------------------------------


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    have = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile") if f in flags]
    import rtpcore_native._kernels as kernels

    ok, reason = kernels.amx_probe()
    cap = os.environ.get("RTPCORE_CPU_ISA")
    return (f"{model}; {', '.join(have)}; {os.cpu_count()} CPUs; rtpcore kernels: {kernels.isa()}"
            f"{'' if ok else f' (AMX not used: {reason})'}{f'; --cpu-isa {cap}' if cap else ''}")


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llamacpp", type=Path, default=Path(os.environ.get("LLAMACPP_DIR", "/work/llamacpp")),
                        help="setup_llamacpp.sh's DIR (default: $LLAMACPP_DIR or /work/llamacpp)")
    parser.add_argument("--types", default="f32,q8_0,q4_k_m", help="GGUF files to run (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-server", action="store_true", help="no llama-server batch row")
    parser.add_argument("--load-only", action="store_true",
                        help="only the load time and memory of both engines (after a 4-token generation)")
    parser.add_argument("--cpu-isa", choices=["avx2", "avx512", "avx512_bf16", "amx"], default=None,
                        help="cap rtpcore's CPU kernels (and torch's) as on a CPU of this class (rtpcore --cpu-isa)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread per engine, CPU time per token (robust to other load; see above)")
    parser.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "llama-1024x16"],
                        help="the checkpoint's shape (benchmarks/_smollm2.py; default: %(default)s)")
    parser.add_argument("--ckpt", type=Path, default=None,
                        help="where benchmarks/_smollm2.py's checkpoint is (made there if missing; default: DIR/ckpt)")
    args = parser.parse_args()
    if args.cpu_isa is not None:  # checked here (a value this CPU cannot run fails now), shown by cpu_line
        from rtpcore.models.cpu_isa import check_cpu_isa

        os.environ["RTPCORE_CPU_ISA"] = check_cpu_isa(args.cpu_isa)

    sys.path.insert(0, str(HERE))
    from _smollm2 import make_checkpoint

    ckpt = make_checkpoint(args.ckpt or args.llamacpp / "ckpt", args.model)
    name = ckpt.name.lower()
    if not all((args.llamacpp / f"{name}-{t}.gguf").is_file() for t in args.types.split(",")):
        subprocess.run(["bash", str(SETUP), str(args.llamacpp), str(ckpt)], check=True)
    print(f"CPU: {cpu_line()}")
    print(f"threads {THREADS} per engine; {args.new_tokens} new tokens; prompt {PROMPT}; prefill {PREFILL}; "
          f"batch {BATCH}; load average {os.getloadavg()[0]:.2f}")
    if args.cpu_time:
        cpu_time_run(args, ckpt, name)
        return
    rows = []
    for t in args.types.split(","):
        gguf = args.llamacpp / f"{name}-{t}.gguf"
        ours = rtpcore_row(gguf, args.new_tokens, args.repeats, args.cpu_isa, load_only=args.load_only)
        py = llama_cpp_python(args.llamacpp, gguf, args.new_tokens, args.repeats, load_only=args.load_only)
        if args.load_only:
            rows.append((t, gguf.stat().st_size / 2**20, ours, py))
            print(f"\n{t}: rtpcore {_rounded(ours)}\n   llama-cpp-python {_rounded(py)}")
            continue
        bench = llama_bench(args.llamacpp, gguf, args.new_tokens)
        server = {} if args.skip_server else llama_server_batch(args.llamacpp, gguf, args.new_tokens)
        peer_decode = max(bench.get("decode_tps", 0), py.get("decode_tps", 0)) or None
        rows.append((t, ours, bench, py, server, peer_decode))
        print(f"\n{t}: rtpcore {_rounded(ours)}")
        print(f"   llama-bench {bench}; llama-cpp-python {_rounded(py)}; llama-server {server}")
        print(f"   decode {ratio(ours['decode_tps'], peer_decode)}, prefill {ratio(ours['prefill_tps'], bench.get('prefill_tps'))}, "
              f"batch {BATCH} {ratio(ours['batch_tps'], server.get('batch_tps'))}, steady memory "
              f"{ratio(ours['rss_mib'], py.get('rss_mib'))} (rtpcore / llama-cpp-python), load "
              f"{ours['load_s']:.2f} s vs {py.get('load_s', float('nan')):.2f} s")
    if args.load_only:
        _load_table(rows)
        return
    if "f32" in args.types.split(","):
        st = rtpcore_row(ckpt, args.new_tokens, args.repeats, args.cpu_isa, dtype="float32")
        f32 = next(r for r in rows if r[0] == "f32")
        print(f"\nsafetensors float32: rtpcore decode {st['decode_tps']:.1f} tok/s, {ratio(st['decode_tps'], f32[5])} "
              f"of llama.cpp F32's {f32[5]:.1f}; prefill {ratio(st['prefill_tps'], f32[2].get('prefill_tps'))} "
              f"(kernel: {st['decode_kernel']} / {st['prefill_kernel']})")
    print("\n| file | decode tok/s rtpcore / llama.cpp | prefill 512 | batch 8 | RSS MiB steady / peak, rtpcore | "
          "llama.cpp | load s rtpcore / llama.cpp | rtpcore kernel: decode / prefill / batch 8 |")
    print("|---|---|---|---|---|---|---|---|")
    if "q8_0" in args.types.split(","):
        i8 = rtpcore_row(ckpt, args.new_tokens, args.repeats, args.cpu_isa, dtype="float32", quantization="int8")
        q8 = next(r for r in rows if r[0] == "q8_0")
        print(f"\nsafetensors int8 (quantization='int8'): rtpcore decode {i8['decode_tps']:.1f} tok/s, "
              f"{ratio(i8['decode_tps'], q8[5])} of llama.cpp Q8_0's {q8[5]:.1f}; prefill "
              f"{ratio(i8['prefill_tps'], q8[2].get('prefill_tps'))}; batch {BATCH} "
              f"{ratio(i8['batch_tps'], q8[4].get('batch_tps'))}")
    for t, ours, bench, py, server, peer in rows:
        print(f"| {t} | {ours['decode_tps']:.1f} / {peer or 0:.1f} ({ratio(ours['decode_tps'], peer)}) | "
              f"{ours['prefill_tps']:.0f} / {bench.get('prefill_tps', 0):.0f} ({ratio(ours['prefill_tps'], bench.get('prefill_tps'))}) | "
              f"{ours['batch_tps']:.1f} / {server.get('batch_tps', 0):.1f} ({ratio(ours['batch_tps'], server.get('batch_tps'))}) | "
              f"{ours['rss_mib']:.0f} / {ours['peak_mib']:.0f} | {py.get('rss_mib', 0):.0f} / {py.get('peak_mib', 0):.0f} | "
              f"{ours['load_s']:.2f} / {py.get('load_s', float('nan')):.2f} | "
              f"{ours['decode_kernel']} / {ours['prefill_kernel']} / {ours['batch_kernel']} |")


def _rounded(row: dict[str, Any]) -> str:
    return json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})


def _load_table(rows: list[Any]) -> None:
    """--load-only's table: load time and memory after a short generation, both engines."""
    print("\n| file | MiB | load s rtpcore / llama.cpp | steady RSS MiB rtpcore (file-backed) / llama.cpp | "
          "peak RSS MiB rtpcore / llama.cpp |")
    print("|---|---|---|---|---|")
    for t, size, ours, py in rows:
        print(f"| {t} | {size:.0f} | {ours['load_s']:.2f} / {py.get('load_s', float('nan')):.2f} | "
              f"{ours['rss_mib']:.0f} ({ours['file_mib']:.0f}) / {py.get('rss_mib', 0):.0f} | "
              f"{ours['peak_mib']:.0f} / {py.get('peak_mib', 0):.0f} |")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()

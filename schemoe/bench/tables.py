"""Markdown tables from the raw outputs of `schemoe bench ...`, `train` and `validate`.

A table maker takes the texts of a figure's raw outputs (in command order) and returns a
`Table`: column names, rows of cells (the first cell names the row, the same in every run), and
the claims the table makes, each with whether it holds in this run. Every number comes from the
last JSON line a command printed (`{"results": [...], ...}` for the benches).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Claim", "Table", "config_line", "last_json"]


@dataclass(frozen=True)
class Claim:
    """One comparison the table makes, e.g. "schemoe r=4 faster than sequential r=1"."""

    text: str
    holds: bool
    value: str = ""  # the number it rests on, e.g. "1.44x"


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]
    claims: list[Claim] = field(default_factory=list)

    def markdown(self) -> str:
        out = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        out += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(out)


def config_line(text: str) -> dict[str, str]:
    """The `# config: k=v ...` header line of a bench output, as a dict (empty if none)."""
    for line in text.splitlines():
        if line.startswith("# config:"):
            return dict(kv.split("=", 1) for kv in line[len("# config:") :].split() if "=" in kv)
    return {}


def last_json(text: str) -> dict:
    """The last line of `text` that is a JSON object (what every bench prints last)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output (did the command finish?)")


def _x(v: float) -> str:
    return f"{v:.2f}x"


def _ms(v: float) -> str:
    return f"{v:.1f}"


def _row(rows: list[dict], **kv) -> dict:
    for r in rows:
        if all(r.get(k) == v for k, v in kv.items()):
            return r
    raise ValueError(f"no result row with {kv}")


def _best(rows: list[dict], pred: Callable[[dict], bool]) -> dict:
    cand = [r for r in rows if pred(r)]
    if not cand:
        raise ValueError("no result row matches")
    return min(cand, key=lambda r: r["median_ms"])


def _faster(text: str, ratio: float) -> Claim:
    return Claim(text, ratio >= 1.0, _x(ratio))


def _bounded(rows: list[dict], bound: Callable[[dict], float]) -> Claim:
    """The bench's lower bound is one: no row measured below it (the closest row's time / bound).
    The bench states the bound; whether a noisy run undercuts it is this claim's to say."""
    ratio = min(r["median_ms"] / bound(r) for r in rows)
    return Claim("no row below its lower bound", ratio >= 1.0, _x(ratio))


# --- bench layer ------------------------------------------------------------------------------


def layer_vs_baseline(texts: Sequence[str]) -> Table:
    """Sequential r=1 (the baseline), DeepSpeed if there, the best row of each policy."""
    js = last_json(texts[0])
    rows = js["results"]
    base = _row(rows, policy="sequential", chunks=1, algorithm="naive")["median_ms"]
    out = [["sequential r=1 (baseline)", "naive r=1", _ms(base), "1.00x"]]
    claims = []
    for pol in dict.fromkeys(r["policy"] for r in rows):
        if pol == "sequential":
            continue
        b = _best(rows, lambda r, p=pol: r["policy"] == p)
        label = "DeepSpeed-MoE" if pol == "deepspeed" else f"best {pol}"
        sched = "its own" if pol == "deepspeed" else f"{b['algorithm']} r={b['chunks']}"
        out.append([label, sched, _ms(b["median_ms"]), _x(base / b["median_ms"])])
        claims.append(_faster(f"{label} faster than sequential r=1", base / b["median_ms"]))
    if "lower_bound_ms" in js:
        out.append(["lower bound max(compute, all-to-all)", "", _ms(js["lower_bound_ms"]), ""])
        ours = [r for r in rows if r["policy"] != "deepspeed"]  # the bound is of schemoe's layer
        claims.append(_bounded(ours, lambda r: js["lower_bound_ms"]))
    return Table(["row", "schedule", "median ms", "vs sequential r=1"], out, claims)


def layer_per_algorithm(texts: Sequence[str]) -> Table:
    """Per algorithm: the best schedule against that algorithm's sequential r=1."""
    rows = last_json(texts[0])["results"]
    out, claims = [], []
    for algo in dict.fromkeys(r["algorithm"] for r in rows):
        seq = _row(rows, policy="sequential", chunks=1, algorithm=algo)["median_ms"]
        b = _best(rows, lambda r, a=algo: r["algorithm"] == a)
        span = f"{b['p10_ms']:.0f}-{b['p90_ms']:.0f}"
        sched = f"{b['policy']} r={b['chunks']}"
        out.append([algo, sched, _ms(b["median_ms"]), span, _ms(seq), _x(seq / b["median_ms"])])
        claims.append(_faster(f"{algo}: best schedule faster than its sequential r=1", seq / b["median_ms"]))  # fmt: skip
    cols = [
        "algorithm",
        "best schedule",
        "median ms",
        "p10-p90 ms",
        "sequential r=1 ms",
        "speed-up",
    ]
    return Table(cols, out, claims)


def layer_compress(texts: Sequence[str]) -> Table:
    """Per compressor: each policy's best r, and schemoe's best against uncompressed."""
    rows = last_json(texts[0])["results"]
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    comps = list(dict.fromkeys(r["compressor"] for r in rows))
    none = _best(rows, lambda r: r["compressor"] == "none")["median_ms"]
    out, claims = [], []
    for c in comps:
        cells = []
        for p in pols:
            b = _best(rows, lambda r, c=c, p=p: r["compressor"] == c and r["policy"] == p)
            cells.append(f"r={b['chunks']}, {_ms(b['median_ms'])}")
        best = _best(rows, lambda r, c=c: r["compressor"] == c)["median_ms"]
        out.append([c, *cells, _x(none / best)])
        if c != "none":
            claims.append(_faster(f"{c}: the layer faster than uncompressed", none / best))
    return Table(["compressor (fwd/bwd)", *[f"{p} best r, ms" for p in pols], "best vs none"], out, claims)  # fmt: skip


def layer_vs_deepspeed(texts: Sequence[str]) -> Table:
    """schemoe's sequential layer against DeepSpeed's in the same run (compute, no shaping)."""
    rows = last_json(texts[0])["results"]
    ours = _row(rows, policy="sequential", chunks=1)["median_ms"]
    ds = _row(rows, policy="deepspeed")["median_ms"]
    out = [
        ["schemoe sequential r=1", _ms(ours), _x(ours / ds)],
        ["DeepSpeed-MoE", _ms(ds), "1.00x"],
    ]
    claims = [Claim("schemoe within 1.10x of DeepSpeed's time", ours / ds <= 1.10, _x(ours / ds))]
    return Table(["row", "median ms", "/ DeepSpeed"], out, claims)


def auto_noprofile(texts: Sequence[str]) -> Table:
    """auto (quick profile measured on its first call) against the best fixed row."""
    js = last_json(texts[0])
    rows = js["results"]
    auto = next(r for r in rows if r["policy"].startswith("auto"))
    best = _best(rows, lambda r: not r["policy"].startswith("auto"))
    secs = sum(p["seconds"] for p in js.get("auto_profile") or [])
    ratio = auto["median_ms"] / best["median_ms"]
    c = config_line(texts[0])
    shape = f"T={c['tokens']} M={c['model_dim']} H={c['hidden_dim']} E={c['experts']}"
    out = [[shape, f"{auto['policy'][5:]} r={auto['chunks']}", _ms(auto["median_ms"]),
            f"{best['policy']} r={best['chunks']}", _ms(best["median_ms"]), f"{ratio:.3f}x",
            f"{secs:.1f} s"]]  # fmt: skip
    claims = [Claim("auto within 5% of the best fixed row", ratio <= 1.05, f"{ratio:.3f}x")]
    cols = ["shape", "auto chose", "auto ms", "best fixed row", "best ms", "auto / best", "quick profile"]  # fmt: skip
    return Table(cols, out, claims)


def _name(r: dict) -> str:
    return f"{r['policy'].removeprefix('auto:')} {r['algorithm']} r={r['chunks']}"


def costmodel(texts: Sequence[str]) -> Table:
    """profile, bench layer --predict, validate: the model's error and auto against the best."""
    rows = last_json(texts[1])["results"]
    val = last_json(texts[2])
    auto = next(r for r in rows if r["policy"].startswith("auto"))
    best = _best(rows, lambda r: not r["policy"].startswith("auto"))
    seq = _row(rows, policy="sequential", chunks=1, algorithm="naive")["median_ms"]
    a_b, a_s = auto["median_ms"] / best["median_ms"], auto["median_ms"] / seq
    out = [
        ["configurations priced", str(val["configurations"])],
        ["median abs error", f"{100 * val['median_abs_error']:.1f}%"],
        ["worst abs error", f"{100 * val['worst_abs_error']:.1f}%"],
        ["auto chose", f"{_name(auto)}, {_ms(auto['median_ms'])} ms"],
        ["best measured", f"{_name(best)}, {_ms(best['median_ms'])} ms"],
        ["auto / best", f"{a_b:.3f}x"],
        ["auto / sequential r=1", f"{a_s:.3f}x"],
    ]
    claims = [
        Claim("auto within 5% of the best measured row", a_b <= 1.05, f"{a_b:.3f}x"),
        Claim("auto no slower than sequential r=1", a_s <= 1.0, f"{a_s:.3f}x"),
    ]
    return Table(["quantity", "value"], out, claims)


# --- bench a2a --------------------------------------------------------------------------------


def a2a(texts: Sequence[str]) -> Table:
    """Per size: limit, each algorithm's time / limit (with the parts when measured), and pipe's
    claims: within 1.15x of the limit, faster than pairwise."""
    rows = last_json(texts[0])["results"]
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    parts = "intra_ms" in rows[0]
    out, claims = [], []
    for size in dict.fromkeys(r["bytes"] for r in rows):
        at = {r["algorithm"]: r for r in rows if r["bytes"] == size}
        limit = next(iter(at.values()))["limit_ms"]
        label = f"{size / 2**20:g} MiB" if size >= 2**20 else f"{size // 1024} KiB"
        cells = [label]
        if parts:
            cells += [_ms(at["pipe"]["intra_ms"]), _ms(at["pipe"]["inter_ms"])]
        cells.append(f"{limit:.2f}")
        cells += [f"{_ms(at[a]['median_ms'])} ({_x(at[a]['median_ms'] / limit)})" for a in algos]
        if "pipe" in at and "pairwise" in at:
            pp = at["pairwise"]["median_ms"] / at["pipe"]["median_ms"]
            cells.append(_x(pp))
            claims.append(_faster(f"{label}: pipe faster than pairwise", pp))
        if "pipe" in at:
            r = at["pipe"]["median_ms"] / limit
            claims.append(Claim(f"{label}: pipe within 1.15x of the limit", r <= 1.15, _x(r)))
        out.append(cells)
    cols = ["bytes/rank", *(["intra ms", "inter ms"] if parts else []), "limit ms", *algos]
    if "pipe" in algos and "pairwise" in algos:
        cols.append("pairwise / pipe")
    return Table(cols, out, claims)


# --- bench step -------------------------------------------------------------------------------


def _step_label(r: dict) -> str:
    if r["policy"] == "deepspeed":
        return f"DeepSpeed-MoE + DDP, m={r.get('micro_chunks', 1)}"
    pay = "bf16" if r["grad_compress"] == "bf16" else "fp32"
    win = f", window {r['grad_window']}" if r.get("grad_window", 1) != 1 else ""
    return (
        f"{r['policy']} r={r['chunks']} m={r.get('micro_chunks', 1)}, {r['grad_sync']}, {pay}{win}"
    )


def step(texts: Sequence[str]) -> Table:
    """Every row of bench step against its first row (DDP), with the step model's prediction
    when a validate output follows (bench, [profile, validate])."""
    rows = last_json(texts[0])["results"]
    pred = {}
    if len(texts) >= 3:
        for p in last_json(texts[2])["points"]:
            pred[(p["compressor"], p["chunks"])] = p["predicted_ms"]
    base = rows[0]["median_ms"]
    out, claims = [], []
    for r in rows:
        p = pred.get((f"grad:{r['grad_sync']}/{r['grad_compress']}", r["chunks"]))
        share = f"{100 * r['network_share']:.0f}%"
        label = _step_label(r)
        cells = [label, _ms(r["median_ms"]), _x(base / r["median_ms"]), share]
        out.append(cells + ([_ms(p) if p else ""] if pred else []))
        if r is not rows[0]:
            claims.append(_faster(f"{label} faster than {_step_label(rows[0])}", base / r["median_ms"]))  # fmt: skip
    claims.append(_bounded(rows, lambda r: r["lower_bound_ms"]))
    cols = ["row", "median ms", "vs first row", "network share"] + (
        ["predicted ms"] if pred else []
    )
    return Table(cols, out, claims)


def step_micro(texts: Sequence[str]) -> Table:
    """The baseline (first row), the best row at each m, and DeepSpeed; the row's name in its own
    column, so two runs' tables line up row by row whichever configuration won."""
    rows = last_json(texts[0])["results"]
    base = rows[0]["median_ms"]
    out = [["baseline", _step_label(rows[0]), _ms(base), "1.00x"]]
    claims = []
    ours = [r for r in rows if r["policy"] != "deepspeed"]
    for m in dict.fromkeys(r.get("micro_chunks", 1) for r in ours):
        b = _best(ours, lambda r, m=m: r.get("micro_chunks", 1) == m)
        out.append([f"best at m={m}", _step_label(b), _ms(b["median_ms"]), _x(base / b["median_ms"])])  # fmt: skip
        claims.append(_faster(f"best at m={m} faster than the baseline", base / b["median_ms"]))
    for r in rows:
        if r["policy"] == "deepspeed":
            out.append(["DeepSpeed-MoE + DDP", _step_label(r), _ms(r["median_ms"]), _x(base / r["median_ms"])])  # fmt: skip
    claims.append(_bounded(rows, lambda r: r["lower_bound_ms"]))
    return Table(["row", "configuration", "median ms", "vs baseline"], out, claims)


def step_bound(texts: Sequence[str], names: Sequence[str]) -> Table:
    """bench step runs (one per topology in `names`; the profile and `schemoe validate` outputs
    around them, when the figure has them, are told apart by their JSON): per run its baseline
    (first row), its best row at each m, auto's step choice (--auto-step) and DeepSpeed, each
    with the measured parts and median / measured bound (--measured-bound), the model's
    prediction; claims on the bound, auto's choice and the simulator's median error."""
    runs = [last_json(t) for t in texts]
    benches = [j for j in runs if "results" in j]
    checks = [j for j in runs if "median_abs_error" in j] or [None] * len(benches)
    out, claims = [], []
    for name, js, check in zip(names, benches, checks):
        rows = js["results"]
        ours = [r for r in rows if r["policy"] != "deepspeed"]
        picked = [("baseline", rows[0])]
        for m in dict.fromkeys(r.get("micro_chunks", 1) for r in ours):
            picked.append((f"best at m={m}", _best(ours, lambda r, m=m: r.get("micro_chunks", 1) == m)))  # fmt: skip
        auto = js.get("auto_step")
        if auto:
            picked.append(("auto's step choice", _planned(ours, auto["plan"])))
        picked += [("DeepSpeed-MoE + DDP", r) for r in rows if r["policy"] == "deepspeed"]
        for what, r in picked:
            net, pred = r.get("network_measured_ms"), r.get("predicted_ms")
            out.append([f"{name} {what}", _step_label(r), _ms(r["median_ms"]),
                        _ms(r["compute_measured_ms"]) if "compute_measured_ms" in r else "-",
                        "-" if net is None else _ms(net),
                        _x(r["bound_ratio"]) if "bound_ratio" in r else "-",
                        "-" if pred is None else _ms(pred)])  # fmt: skip
        if "bound_ratio" in rows[0]:
            low = min(r["bound_ratio"] for r in rows)
            claims.append(Claim(f"{name}: no row below its measured bound", low >= 1.0, _x(low)))
            best = _best(ours, lambda r: True)["bound_ratio"]
            claims.append(Claim(f"{name}: the best row within 1.10x of its measured bound", best <= 1.10, _x(best)))  # fmt: skip
        if auto:
            claims.append(Claim(f"{name}: auto's step choice within 5% of the best row", auto["vs_best"] <= 1.05, _x(auto["vs_best"])))  # fmt: skip
        if check:
            err = check["median_abs_error"]
            claims.append(Claim(f"{name}: simulated steps' median |error| within 15%", err <= 0.15, f"{100 * err:.1f}%"))  # fmt: skip
    cols = ["row", "configuration", "median ms", "compute ms (loopback)", "network ms (eth0)",
            "/ measured bound", "predicted ms"]  # fmt: skip
    return Table(cols, out, claims)


def _planned(rows: list[dict], plan: dict) -> dict:
    """The row (window 1) that runs `plan` (`StepPlan.row()`)."""
    return next(
        r for r in rows if r.get("grad_window", 1) == 1 and all(r[k] == v for k, v in plan.items())
    )


# --- train ------------------------------------------------------------------------------------


def _final(js: dict) -> float:
    tail = js["losses"][-10:]
    return sum(tail) / len(tail)


def train_compress(texts: Sequence[str], names: Sequence[str]) -> Table:
    """Final loss (mean of the last 10 steps) per compressor against the first (none)."""
    losses = [_final(last_json(t)) for t in texts]
    out, claims = [], []
    for name, loss in zip(names, losses):
        d = loss / losses[0] - 1
        out.append([name, f"{loss:.3f}", "" if name == names[0] else f"{100 * d:+.1f}%"])
        if name != names[0]:
            claims.append(Claim(f"{name} within 1.1% of {names[0]}'s loss", abs(d) <= 0.011, f"{100 * d:+.1f}%"))  # fmt: skip
    return Table(["compressor", "final loss", f"vs {names[0]}"], out, claims)


def train_policies(texts: Sequence[str], names: Sequence[str]) -> Table:
    """Training runs (after one setup output, e.g. a profile): tokens/s against the last run."""
    js = [last_json(t) for t in texts[len(texts) - len(names) :]]
    base = js[-1]["tokens_per_s"]
    out = [
        [n, f"{j['tokens_per_s']:.0f}", _x(j["tokens_per_s"] / base), f"{j['final_loss']:.4f}",
         f"{j['eval_loss']:.4f}"]
        for n, j in zip(names, js)
    ]  # fmt: skip
    claims = [
        _faster(f"{n} more tokens/s than {names[-1]}", j["tokens_per_s"] / base)
        for n, j in zip(names[:-1], js[:-1])
    ]
    return Table(["policy", "tokens/s", f"vs {names[-1]}", "final loss", "eval loss"], out, claims)


def overhead(texts: Sequence[str]) -> Table:
    js = last_json(texts[0])
    out = [
        ["executor ordering, per task", f"{js['scheduler_us_per_task']:.1f} us"],
        ["whole layer, per extra task (tiny shape)", f"{js['layer_us_per_extra_task']:.1f} us"],
    ]
    return Table(["quantity", "value"], out)

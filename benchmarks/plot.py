"""The figures of the benchmarks. benchmarks/methods.py: tokens/s by method and batch (one panel per temperature)
above acceptance by draft position (one panel per temperature, counts pooled over batches). benchmarks/speculation.py
(`plot_mesh`): engine and mesh tokens/s by streams above the mesh's inter-token latency beside the engine's step time
(one column per prompt set). benchmarks/gpu.py (`plot_gpu`): tokens/s by batch per shape beside transformers and the
weight-read floor, above batch-1 ms/step (one column per context). benchmarks/defaults.py (`plot_defaults`): the
load generator's output tokens/s above its inter-token latency per `specmesh up` configuration (one column alone,
one beside a busy process). benchmarks/heldout.py (`plot_heldout`): decode tokens/s per case, the mesh beside
transformers. benchmarks/prefix_cache.py (`plot_prefix_cache`): time to first token cold and cached per method.
benchmarks/chunked_prefill.py (`plot_chunked_prefill`): the running streams' gaps and tokens/s per prefill setting.
benchmarks/prefix_routing.py (`plot_prefix_routing`): the prefix cache's hit rate per worker count and routing.

    python -m benchmarks.plot bench-out/methods/methods.json   # redraws methods.png beside it
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

try:
    import matplotlib

    matplotlib.use("Agg")  # files only: benchmarks run on machines without a display
    import matplotlib.pyplot as plt
except ModuleNotFoundError:  # a lent GPU machine's image may lack it: the JSON still carries every figure
    plt = None


def drawing(draw: Callable[[dict, Path], None]) -> Callable[[dict, Path], None]:
    """A plot function that says so on stderr, and draws nothing, where matplotlib is not installed."""

    @functools.wraps(draw)
    def draw_if_possible(report: dict, path: Path) -> None:
        if plt is None:
            print(f"matplotlib is not installed: {path} not drawn", file=sys.stderr)
            return
        draw(report, path)

    return draw_if_possible


def save_report(out: Path, stem: str, report: dict, table: str, draw: Callable[[dict, Path], None]) -> None:
    """A benchmark's files in out: stem.json (every figure), table.md (what it printed) and stem.png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "table.md").write_text(table + "\n")
    draw(report, out / f"{stem}.png")
    print(f"wrote {out / f'{stem}.json'}, {out / f'{stem}.png'}, {out / 'table.md'}")


def save_figure(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def grouped_bars(ax: plt.Axes, groups: list[str], series: dict[str, list[float]]) -> None:
    """One bar per series in each group, side by side, series[label][g] the height in group g (nan: no bar),
    the groups named on the x axis."""
    width = BAR_GROUP_WIDTH / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], values, width, label=label)
    ax.set_xticks(range(len(groups)), groups)


BASELINE = "naive"  # the dashed line: what a busy worker must not fall below
BAR_GROUP_WIDTH = 0.8  # fraction of a method's slot that its batch bars fill
ACCEPTANCE_AXIS_TOP = 1.05  # room above 1.0 so lines of always-accepted drafts stay visible
FIGURE_SIZE = (14, 9)
GPU_LINE_STYLES = ("-", ":", "--")  # benchmarks/gpu.py's systems in the order they appear: graphs, eager, transformers
DPI = 120


def _tokens_per_s(ax: plt.Axes, runs: list[dict], temperature: float) -> None:
    runs = [r for r in runs if r["temperature"] == temperature]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    batches = sorted({r["batch"] for r in runs})
    width = BAR_GROUP_WIDTH / len(batches)
    for i, batch in enumerate(batches):
        by_method = {r["method"]: r["tokens_per_s"] for r in runs if r["batch"] == batch}
        xs = [m + (i - (len(batches) - 1) / 2) * width for m, name in enumerate(methods) if name in by_method]
        ax.bar(xs, [by_method[name] for name in methods if name in by_method], width, label=f"batch {batch}")
    for batch in batches[-1:]:
        naive = [r["tokens_per_s"] for r in runs if r["method"] == BASELINE and r["batch"] == batch]
        if naive:
            ax.axhline(naive[0], color="grey", linestyle="--", linewidth=1, label=f"{BASELINE}, batch {batch}")
    ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"throughput, temperature {temperature:g}")
    ax.legend()


def _per_position(ax: plt.Axes, runs: list[dict], temperature: float, colors: dict[str, str]) -> None:
    drafted: dict[str, list[int]] = defaultdict(list)
    accepted: dict[str, list[int]] = defaultdict(list)
    for r in runs:
        if r["temperature"] != temperature or not any(r["drafted_at"]):
            continue
        for totals, counts in ((drafted[r["method"]], r["drafted_at"]), (accepted[r["method"]], r["accepted_at"])):
            totals.extend([0] * (len(counts) - len(totals)))
            for j, n in enumerate(counts):
                totals[j] += n
    for method, d in drafted.items():
        rates = [a / n if n else float("nan") for a, n in zip(accepted[method], d)]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=method, color=colors[method])
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafted")
    ax.set_ylim(0, ACCEPTANCE_AXIS_TOP)
    ax.set_xticks(range(1, max((len(d) for d in drafted.values()), default=1) + 1))
    ax.set_title(f"acceptance by position, temperature {temperature:g} (all batches)")
    ax.legend()


@drawing
def plot(report: dict, path: Path) -> None:
    """Draws report (the JSON benchmarks/methods.py writes) into the PNG at path."""
    runs = report["runs"]
    temperatures = sorted({r["temperature"] for r in runs})
    # A method keeps its colour in every panel.
    colors = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(r["method"] for r in runs))}
    fig, axes = plt.subplots(2, len(temperatures), figsize=FIGURE_SIZE, squeeze=False)
    for col, temperature in enumerate(temperatures):
        _tokens_per_s(axes[0][col], runs, temperature)
        _per_position(axes[1][col], runs, temperature, colors)
    fig.suptitle(f"specmesh drafting methods on {Path(report['model']).name}, {report['max_tokens']} tokens per request")
    save_figure(fig, path)


def _by_streams(ax: plt.Axes, runs: list[dict], lines: dict[str, tuple[str, str]], colors: dict[str, str]) -> None:
    """One line per method and figure (lines: JSON key -> (label, line style)) against the number of streams."""
    for method, color in colors.items():
        mine = sorted((r for r in runs if r["method"] == method), key=lambda r: r["streams"])
        for key, (label, style) in lines.items():
            points = [(r["streams"], r[key]) for r in mine if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), linestyle=style, marker="o", color=color, label=f"{method}, {label}")
    streams = sorted({r["streams"] for r in runs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(streams, [str(s) for s in streams])
    ax.set_xlabel("concurrent streams")
    ax.legend(fontsize="small")


@drawing
def plot_mesh(report: dict, path: Path) -> None:
    """Draws report (the JSON benchmarks/speculation.py writes) into the PNG at path."""
    runs = report["rows"]
    prompt_sets = list(dict.fromkeys(r["prompts"] for r in runs))
    colors = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(r["method"] for r in runs))}
    fig, axes = plt.subplots(2, len(prompt_sets), figsize=FIGURE_SIZE, squeeze=False)
    for col, prompts in enumerate(prompt_sets):
        mine = [r for r in runs if r["prompts"] == prompts]
        top, bottom = axes[0][col], axes[1][col]
        _by_streams(top, mine, {
            "engine_tokens_per_s": ("engine", "-"),
            "engine_beside_busy_core_tokens_per_s": ("engine, another core busy", ":"),
            "mesh_tokens_per_s": ("mesh", "--"),
        }, colors)
        top.set_ylabel("tokens/s")
        top.set_title(f"throughput, {prompts} prompts")
        _by_streams(bottom, mine, {
            "engine_mean_step_ms": ("engine mean step", "-"),
            "mesh_itl_p50_ms": ("mesh inter-token p50", "--"),
            "mesh_itl_p99_ms": ("mesh inter-token p99", ":"),
        }, colors)
        bottom.set_ylabel("ms")
        bottom.set_title(f"latency, {prompts} prompts")
    fig.suptitle(f"engine in-process vs through the mesh on {Path(report['model']).name} ({report['device']}), "
                 f"{report['max_tokens']} tokens per request, greedy")
    save_figure(fig, path)


@drawing
def plot_gpu(report: dict, path: Path) -> None:
    """Draws report (the JSON benchmarks/gpu.py writes) into the PNG at path: per context, tokens/s by batch (one
    colour per shape: specmesh solid, transformers dashed, the weight-read floor a star at batch 1) above batch-1
    ms/step per shape (specmesh with graphs, eager, transformers, floor)."""
    rows, contexts = report["rows"], report["contexts"]
    colors = {s["shape"]: f"C{i}" for i, s in enumerate(report["shapes"])}
    floors = {s["shape"]: s["floor"] for s in report["shapes"]}
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, axes = plt.subplots(2, len(contexts), figsize=FIGURE_SIZE, squeeze=False)
    for col, context in enumerate(contexts):
        top, bottom = axes[0][col], axes[1][col]
        mine = [r for r in rows if r["context"] == context]
        for name, color in colors.items():
            for system, style in zip(systems, GPU_LINE_STYLES):
                points = sorted((r["batch"], r["tokens_per_s"]) for r in mine
                                if (r["shape"], r["system"]) == (name, system))
                if len(points) > 1:
                    top.plot(*zip(*points), linestyle=style, marker="o", color=color, label=f"{name}, {system}")
            top.plot([1], [floors[name]["tokens_per_s_batch1"]], marker="*", markersize=12, linestyle="none",
                     color=color, label=f"{name}, weight-read floor")
        batches = sorted({r["batch"] for r in mine})
        top.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s (higher is better)",
                title=f"context {context}")
        top.set_xticks(batches, [str(b) for b in batches])
        top.legend(fontsize="x-small")
        names = list(colors)
        bars = {system: [next((r["ms_per_step"] for r in mine if (r["shape"], r["system"], r["batch"]) ==
                               (name, system, 1)), float("nan")) for name in names] for system in systems}
        bars["weight-read floor"] = [floors[name]["ms_per_step"] for name in names]
        grouped_bars(bottom, names, bars)
        bottom.set(yscale="log", ylabel="ms per decode step, batch 1 (lower is better)",
                   title=f"batch 1, context {context}")
        bottom.legend(fontsize="small")
    fig.suptitle(f"plain greedy decoding, {report['dtype']} on {report['device_name']}; transformers: "
                 f"{report['transformers_mode']}", fontsize="medium")
    save_figure(fig, path)


@drawing
def plot_defaults(report: dict, path: Path) -> None:
    """Draws report (the JSON benchmarks/defaults.py writes) into the PNG at path: per configuration, bars by
    concurrency of the load generator's output tokens/s above its average inter-token latency; left alone, right
    beside a busy process (when measured)."""
    rows = report["rows"]
    configs = list(report["configs"])
    levels = sorted({r["concurrency"] for r in rows})
    busy_levels = sorted({r["busy"] for r in rows})
    fig, axes = plt.subplots(2, len(busy_levels), figsize=FIGURE_SIZE, squeeze=False)
    for col, busy in enumerate(busy_levels):
        for ax, figure, label in ((axes[0][col], "output_tokens_per_s", "output tokens/s (higher is better)"),
                                  (axes[1][col], "itl_ms", "inter-token latency avg, ms (lower is better)")):
            grouped_bars(ax, configs, {
                f"concurrency {level}": [next((r[figure] for r in rows if (r["config"], r["busy"], r["concurrency"])
                                               == (name, busy, level)), float("nan")) for name in configs]
                for level in levels
            })
            ax.set(ylabel=label, title="beside a busy process" if busy else "alone")
            ax.legend(fontsize="small")
    load_generator = report.get("load_generator") or f"aiperf {report['aiperf']}"  # older reports name aiperf's version
    fig.suptitle(f"specmesh up through {load_generator}: {report['isl']} synthetic prompt tokens, "
                 f"{report['osl']} output tokens; defaults here: {report['defaults_cpu_plan']}", fontsize="small")
    save_figure(fig, path)


@drawing
def plot_heldout(report: dict, path: Path) -> None:
    """Draws report (the JSON benchmarks/heldout.py writes) into the PNG at path: per case, a bar per system."""
    rows = report["rows"]
    systems = list(dict.fromkeys(system for row in rows for system in row["decode_tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(FIGURE_SIZE[0], FIGURE_SIZE[1] / 2))
    rates = {system: [row["decode_tokens_per_s"].get(system, float("nan")) for row in rows] for system in systems}
    grouped_bars(ax, [row["case"] for row in rows], rates)
    ax.set(ylabel="decode tokens/s after the first token (higher is better)")
    ax.legend(fontsize="small")
    fig.suptitle(f"{report['mesh']} ({report['mesh_cpu_plan']}) against transformers ({report['transformers_threads']} "
                 f"threads) on {report['package']}'s code, greedy", fontsize="small")
    save_figure(fig, path)


@drawing
def plot_prefix_cache(report: dict, path: Path) -> None:
    """Draws report (the JSON benchmarks/prefix_cache.py writes) into the PNG at path: per method, time to first
    token cold and with its prompt cached."""
    rows = report["methods"]
    fig, ax = plt.subplots(figsize=(FIGURE_SIZE[0] / 2, FIGURE_SIZE[1] / 2))
    grouped_bars(ax, [row["method"] for row in rows], {
        "cold": [row["cold_ttft_ms"] for row in rows], "prompt cached": [row["hot_ttft_ms"] for row in rows],
    })
    ax.set(ylabel="time to first token, ms (lower is better)")
    ax.legend(fontsize="small")
    fig.suptitle(f"{report['prompt_tokens']}-token prompts from {report['package']}, through the mesh, median of "
                 f"{report['rounds']}", fontsize="small")
    save_figure(fig, path)


@drawing
def plot_chunked_prefill(report: dict, path: Path) -> None:
    """Draws report (the JSON benchmarks/chunked_prefill.py writes) into the PNG at path: per prefill setting, the
    running streams' worst and p99 gap beside their tokens/s and the long prompts' time to first token."""
    rows = report["rows"]
    names = [row["config"] for row in rows]
    fig, (gaps, rates) = plt.subplots(1, 2, figsize=(FIGURE_SIZE[0], FIGURE_SIZE[1] / 2))
    grouped_bars(gaps, names, {
        "worst gap": [row["worst_gap_ms"] for row in rows], "p99 gap": [row["p99_gap_ms"] for row in rows],
        "long prompt TTFT": [row["long_ttft_ms"] for row in rows],
    })
    gaps.set(ylabel="ms (lower is better)")
    gaps.legend(fontsize="small")
    grouped_bars(rates, names, {"running streams": [row["tokens_per_s"] for row in rows]})
    rates.set(ylabel="tokens/s of the running streams")
    for ax in (gaps, rates):
        ax.tick_params(axis="x", labelsize="small", rotation=20)
    fig.suptitle(f"{report['streams']} streams decoding while {report['arrivals']} prompts of "
                 f"{report['long_prompt_tokens']} tokens arrive, through the mesh, median of {report['rounds']}",
                 fontsize="small")
    save_figure(fig, path)


@drawing
def plot_prefix_routing(report: dict, path: Path) -> None:
    """Draws report (the JSON benchmarks/prefix_routing.py writes) into the PNG at path: per worker count, the hit
    rate with the shared queue and with prefix-aware routing."""
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(FIGURE_SIZE[0] / 2, FIGURE_SIZE[1] / 2))
    grouped_bars(ax, [f"{row['workers']} workers" for row in rows], {
        name: [row[name] for row in rows] for name in ("shared queue", "prefix-aware")
    })
    ax.set(ylabel="prompt tokens found cached, turns 2.. (higher is better)", ylim=(0, 1))
    ax.legend(fontsize="small")
    fig.suptitle(f"{report['conversations']} chats at once, {report['turns']} turns each, median of "
                 f"{report['rounds']}", fontsize="small")
    save_figure(fig, path)


@drawing
def plot_mesh_ab(report: dict, path: Path) -> None:
    """Draws report (the JSON benchmarks/mesh_ab.py writes) into the PNG at path: per method, its tokens/s over the
    baseline's through the mesh, the median of the rounds with their range."""
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(FIGURE_SIZE[0] / 2, FIGURE_SIZE[1] / 2))
    medians = [row["ratio"] for row in rows]
    spread = [[m - row["ratio_min"] for m, row in zip(medians, rows)],
              [row["ratio_max"] - m for m, row in zip(medians, rows)]]
    ax.bar(range(len(rows)), medians, yerr=spread, capsize=4)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [f"{row['method']}, {row['streams']} stream(s)" for row in rows])
    ax.set(ylabel=f"mesh tokens/s over {report['baseline']}'s (higher is better)")
    fig.suptitle(f"{report['prompts']} prompts, T={report['temperature']}, passes alternating with "
                 f"{report['baseline']}'s, median and range of {report['rounds']} rounds", fontsize="small")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="methods.json written by benchmarks/methods.py")
    args = parser.parse_args()
    plot(json.loads(args.report.read_text()), args.report.with_suffix(".png"))


if __name__ == "__main__":
    main()

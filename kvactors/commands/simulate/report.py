"""Presenting a run: the summary table, and the plot of hit rate and throughput over time."""

from __future__ import annotations

import itertools

from rich.table import Table

from kvactors.commands.simulate.run_metrics import CPU, CPU_IN_FLIGHT, percentile
from kvactors.commands.simulate.runner import SimResult

HIT_RATE_NOTE = (
    "Hit rate: prompt blocks loaded from the pool / prompt blocks looked up, over every attempt. "
    f"'{CPU}': ready in the pool at the first lookup; '{CPU_IN_FLIGHT}': being stored by another "
    "request then; a tier's name: promoted from that tier (disk, redis) while the request waited."
)
GBPS_NOTE = "GB/s: bytes moved between the device cache and the pool / the run's wall time (all threads)."
FINALIZE_NOTE = ("Finalize latency: from the moment the attempt's last offload resolved (or its finish, if later) "
                 "to the moment the last secondary tier ran on_request_finished.")
DEFINITIONS = (HIT_RATE_NOTE, GBPS_NOTE, FINALIZE_NOTE)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _zero(value: int) -> str:
    return f"[green]{value}[/green]" if value == 0 else f"[bold red]{value}[/bold red]"


def summary_table(result: SimResult, *, event_log: str | None, check_log: str) -> Table:
    cfg = result.config
    c = result.counts
    table = Table(title="kvactors simulate", show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value")
    tiers = ", ".join(["cpu pool " + str(cfg.cpu_blocks) + " blocks", *result.tiers])
    table.add_row("set-up", f"{cfg.threads} threads, device {cfg.device}, blocks of {_size(cfg.block_bytes)}, "
                            f"tiers: {tiers}")
    table.add_row("requests", f"{result.requests} turns of {result.conversations} conversations in "
                              f"{result.seconds:.1f} s ({c['completed']} completed, {c['aborts']} aborted, "
                              f"{c['preemptions']} preemptions; {c['attempts']} attempts)"
                              + (" [bold yellow]interrupted[/bold yellow]" if result.interrupted else ""))
    by_tier = ", ".join(f"{cat} {result.hit_rate_of(cat):.1%}" for cat in result.hit_categories)
    table.add_row("prefix hit rate", f"{result.hit_rate:.1%} of {c['keys_looked_up']} blocks ({by_tier})")
    stored = ", ".join(f"{t} {result.cascaded.get(t, 0)}" for t in result.tiers)
    promoted = ", ".join(f"{t} {result.promotions.get(t, 0)}" for t in result.tiers)
    table.add_row("tier traffic", f"blocks stored: {stored}; promoted: {promoted}; {c['load_races']} load races, "
                                  f"{c['pending_timeouts']} pending timeouts")
    table.add_row("offloaded", f"{_size(c['bytes_offloaded'])}, {result.gbps('offloaded'):.3f} GB/s")
    table.add_row("onboarded", f"{_size(c['bytes_onboarded'])}, {result.gbps('onboarded'):.3f} GB/s")
    table.add_row("finalize latency", f"p50 {percentile(result.finalize_ms, 50):.2f} ms, "
                                      f"p99 {percentile(result.finalize_ms, 99):.2f} ms "
                                      f"({len(result.finalize_ms)} attempts)")
    if c["transfer_errors"] or c["frontend_errors"]:
        table.add_row("errors", f"{c['transfer_errors']} transfer, {c['frontend_errors']} frontend")
    table.add_row("contract violations", _zero(result.violations))
    table.add_row("byte mismatches", _zero(result.mismatches))
    table.add_row("leaked states", _zero(result.leaks))
    table.add_row("lifecycle log", event_log or "none")
    table.add_row("check-log", check_log)
    return table


def notes(result: SimResult) -> list[str]:
    """What went wrong, one line each (empty for a clean run)."""
    out = [f"violation: {n}" for n in result.violation_notes]
    if result.violations and not result.violation_notes:
        out.append(f"violation: the runtime counted {result.stats.get('contract_violations')} contract "
                   f"violations and {result.stats.get('internal_errors')} internal errors (see the log)")
    out += [f"mismatch: {n}" for n in result.mismatch_notes]
    out += [f"leak: {n}" for n in result.leak_notes]
    out += [f"error: {n.strip()}" for n in result.errors]
    return out


def plot(result: SimResult, path: str) -> None:
    """Hit rate and offload/onboard throughput per sampling interval, against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result.samples
    ts, hit, off, on = [], [], [], []
    for a, b in itertools.pairwise(samples):
        dt = b.t - a.t
        if dt <= 0:
            continue
        looked = b.keys_looked_up - a.keys_looked_up
        ts.append(b.t)
        hit.append(100.0 * (b.keys_hit - a.keys_hit) / looked if looked else float("nan"))
        off.append((b.bytes_offloaded - a.bytes_offloaded) / dt / 1e9)
        on.append((b.bytes_onboarded - a.bytes_onboarded) / dt / 1e9)
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    ax1.plot(ts, hit, color="tab:green")
    ax1.set_ylabel("prefix hit rate (%)")
    ax1.set_ylim(0, 100)
    ax1.set_title(f"kvactors simulate: {result.requests} requests, {result.config.threads} threads")
    ax2.plot(ts, off, label="offload")
    ax2.plot(ts, on, label="onboard")
    ax2.set_ylabel("GB/s")
    ax2.set_xlabel("time (s)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

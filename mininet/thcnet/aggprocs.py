"""The software aggregators a testbed runs as processes (``thc aggregator``: one central, or
one per shard on the workers' hosts): starting them, their CPU time and counters, stopping
them. A part of :class:`thc.emu.base.Testbed`, which supplies the processes and addresses."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from thc.emu.errors import TestbedError
from thc.emu.procs import Proc

AGG_START_TIMEOUT = 30.0


class AggregatorProcesses:
    def _aggregator_procs(self) -> list[tuple[str, Proc]]:
        procs = [(f"aggregator shard {i}", p) for i, p in enumerate(self._shard_procs)]
        if self.agg_proc is not None:
            procs.append(("the aggregator", self.agg_proc))
        return procs

    def aggregator_datapath(self) -> str | None:
        """Which datapath the software aggregators serve on, as their listening lines say
        ("compiled (...)", or "python (why)": it falls back where the compiled one cannot
        serve the job); None without one."""
        said = []
        for _, proc in self._aggregator_procs():
            line = next((ln for ln in proc.stdout().splitlines() if "listening" in ln), "")
            said.append(line.partition(", datapath ")[2] or "unknown")
        return "; ".join(sorted(set(said))) or None

    def aggregator_cpu_seconds(self) -> float | None:
        """CPU seconds (user + system) the running software aggregator or its shards have used
        so far, from /proc (None without one)."""
        procs = [p for _, p in self._aggregator_procs()]
        if not procs:
            return None
        total = 0.0
        for proc in procs:
            try:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                return None
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def _spawn_aggregator(self, node, listen: tuple[str, int], name: str,
                          shard: int | None = None) -> Proc:
        """Start `thc aggregator` (whichever implementation it runs) on ``node``."""
        stats = self.logdir / f"{name}-stats.json"
        stats.unlink(missing_ok=True)
        argv = ["python", "-m", "thc.cli", "aggregator", "--listen", f"{listen[0]}:{listen[1]}",
                "--config", str(self.cluster_path), "--stats-interval", "0",
                "--stats-file", str(stats), *self.agg_link_args] + list(self.agg_args)
        if shard is not None:
            argv += ["--shard", str(shard)]
        return self.popen(node, argv, name=name)

    def _await_listening(self, procs: list[Proc]) -> None:
        end = time.monotonic() + AGG_START_TIMEOUT
        for proc in procs:
            while "listening" not in proc.stdout():
                if proc.poll() is not None:
                    raise TestbedError(f"the software aggregator {proc.name} exited with code "
                                       f"{proc.popen.returncode}: "
                                       f"{proc.stderr().strip()[-2000:]}")
                if time.monotonic() > end:
                    proc.kill()
                    raise TestbedError(f"the software aggregator {proc.name} did not start "
                                       f"within {AGG_START_TIMEOUT:.0f} s")
                time.sleep(0.05)

    def _start_software_aggregator(self, node: str, listen: tuple[str, int]) -> None:
        self._agg_final = None
        proc = self._spawn_aggregator(node, listen, "aggregator")
        self._await_listening([proc])
        self.agg_proc = proc

    def _start_shards(self) -> None:
        """One shard on every worker host, listening at its shard map address."""
        if self._shard_procs:
            return
        self._agg_final = None
        procs = [self._spawn_aggregator(r, (s.ip, s.port), f"shard{r}", shard=r)
                 for r, s in enumerate(self.job.shards)]
        self._shard_procs = procs
        self._await_listening(procs)

    def start_aggregator(self) -> None:
        """Start the testbed's aggregator(s): the central one, the shards, or the switch."""
        self._check_open()
        if self.aggregator == "sharded":
            self._start_shards()
        elif self.aggregator == "software":
            if self.agg_proc is None:
                self._start_software_aggregator("agg", self.agg_addr)
        else:
            self._start_other_aggregator()

    def _start_other_aggregator(self) -> None:
        raise TestbedError(f"this testbed has no aggregator to start "
                           f"(aggregator={self.aggregator!r})")

    def aggregator_counters(self) -> dict | None:
        """The software aggregator's counters (packets, completions, drops), if any.

        While it runs they are at most half a second old (its --stats-file); after
        :meth:`stop_aggregator` they are final.
        """
        if self._agg_final is not None:
            return self._agg_final
        if self.aggregator == "sharded":
            shards = []
            for r in range(len(self.job.shards)):
                try:
                    shards.append(json.loads((self.logdir / f"shard{r}-stats.json").read_text()))
                except (OSError, ValueError):
                    return None
            return sum_shard_counters(shards)
        path = self.logdir / "aggregator-stats.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def fresh_aggregator_counters(self, timeout: float = 30.0) -> dict | None:
        """The software aggregator's counters as taken after this call began: its stats
        files awaited until rewritten twice (:func:`thc.testing.stats.fresh_stats`), so a
        row's counters include every chunk its workers saw complete, however late the
        aggregator's timer runs."""
        from thc.testing.stats import fresh_stats
        if self._agg_final is not None:
            return self._agg_final
        procs = [p for _, p in self._aggregator_procs()]
        if not procs:
            return self.aggregator_counters()
        if self.aggregator == "sharded":
            paths = [self.logdir / f"shard{r}-stats.json" for r in range(len(self.job.shards))]
        else:
            paths = [self.logdir / "aggregator-stats.json"]
        shards = fresh_stats(paths, timeout, alive=lambda: all(p.poll() is None for p in procs))
        return sum_shard_counters(shards) if self.aggregator == "sharded" else shards[0]

    def stop_aggregator(self) -> dict | None:
        """Stop the software aggregator or its shards (SIGINT, as Ctrl-C) and return the final
        counters (summed over the shards, each shard's under ``"shards"``)."""
        import signal
        procs = [p for _, p in self._aggregator_procs()]
        if not procs:
            return self.aggregator_counters()
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGINT)
                except OSError:
                    pass
        finals = []
        for proc in procs:
            try:
                proc.popen.wait(timeout=10)
            except Exception:  # noqa: BLE001 - fall back to killing it
                proc.kill()
            for line in reversed(proc.stdout().strip().splitlines()):
                try:
                    finals.append(json.loads(line))
                    break
                except ValueError:
                    continue
        sharded = bool(self._shard_procs)
        self.agg_proc, self._shard_procs = None, []
        if finals and len(finals) == len(procs):
            self._agg_final = sum_shard_counters(finals) if sharded else finals[0]
        return self.aggregator_counters()


def sum_shard_counters(shards: list[dict]) -> dict:
    """The counters of a sharded aggregator: drops, failed reply sends, receive-queue
    overflows and job counters summed over its shards, each shard's own under ``"shards"``."""
    drops: dict[str, int] = {}
    jobs: dict[str, dict[str, int]] = {}
    send_errors = overflow = 0
    for c in shards:
        send_errors += c.get("send_errors", 0)
        overflow += c.get("queue_overflow") or 0
        for k, v in c.get("drops", {}).items():
            drops[k] = drops.get(k, 0) + v
        for jid, counters in c.get("jobs", {}).items():
            acc = jobs.setdefault(str(jid), {})
            for k, v in counters.items():
                acc[k] = acc.get(k, 0) + v
    return {"drops": drops, "send_errors": send_errors, "queue_overflow": overflow,
            "jobs": jobs, "shards": shards}

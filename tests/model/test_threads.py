"""CPU reads take the cores other processes leave idle: the rule, the /proc accounting, and the context manager."""
from __future__ import annotations

import os

import pytest
import torch

from endo_retrieval.model import threads


def test_fitted_threads_leave_busy_cores_to_others():
    assert threads.fitted_threads(configured=2, cores=2, busy=0.1) == 2  # idle machine: every configured thread
    assert threads.fitted_threads(configured=2, cores=2, busy=1.0) == 1  # one core busy elsewhere
    assert threads.fitted_threads(configured=8, cores=2, busy=0.0) == 2  # never more than the cores
    assert threads.fitted_threads(configured=1, cores=8, busy=0.0) == 1  # torch's configured count is the ceiling
    assert threads.fitted_threads(configured=4, cores=4, busy=7.5) == 1  # at least one
    assert threads.fitted_threads(configured=3, cores=4, busy=None) == 3  # nothing measured: as configured


def write_proc(folder, machine_busy_ticks: int, own_ticks: int) -> None:
    (folder / "self").mkdir(exist_ok=True)
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
    (folder / "stat").write_text(f"cpu  {machine_busy_ticks} 0 0 5000 7 0 0 0 0 0\ncpu0 1 2 3\n")
    fields = ["S"] + ["0"] * 10 + [str(own_ticks), "0"] + ["0"] * 30  # utime is field 14, stime 15
    (folder / "self/stat").write_text("4242 (python (odd) name) " + " ".join(fields))


def test_busy_elsewhere_subtracts_this_process(tmp_path, monkeypatch):
    write_proc(tmp_path, machine_busy_ticks=1000, own_ticks=100)

    def after_window(_seconds):  # over the window, the machine's busy time grows by 0.2 s, this process's by 0.1 s
        write_proc(tmp_path, machine_busy_ticks=1000 + round(0.2 / threads.TICK_S),
                   own_ticks=100 + round(0.1 / threads.TICK_S))

    monkeypatch.setattr(threads.time, "sleep", after_window)
    assert threads.busy_elsewhere(window=0.1, proc=tmp_path) == pytest.approx(1.0)  # one core's worth elsewhere
    assert threads.busy_elsewhere(proc=tmp_path / "absent") is None


def test_a_cpu_read_runs_with_the_fitted_count_and_restores_torchs(monkeypatch):
    configured = torch.get_num_threads()
    monkeypatch.setattr(threads, "_last", {})  # no earlier read's measure
    monkeypatch.setattr(threads, "busy_elsewhere", lambda: 64.0)  # every core taken elsewhere
    with threads.threads_for_cpu_work(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == configured
    monkeypatch.setenv("ENDO_THREADS", "1")
    monkeypatch.setattr(threads, "busy_elsewhere", lambda: pytest.fail("ENDO_THREADS set: nothing to measure"))
    with threads.threads_for_cpu_work(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    monkeypatch.setenv("ENDO_THREADS", "two")
    with pytest.raises(ValueError, match="ENDO_THREADS must be a whole number"):
        with threads.threads_for_cpu_work(torch.device("cpu")):
            pass
    assert torch.get_num_threads() == configured


def test_a_read_measures_the_others_for_the_next_one_back_to_back(monkeypatch):
    monkeypatch.setattr(threads, "_last", {})
    calls = []
    monkeypatch.setattr(threads, "busy_elsewhere", lambda: calls.append(1) or 0.0)
    times = iter([(0.0, 10.0, 5.0), (1.0, 12.0, 6.0)])  # over the read's second: 2 busy cores, 1 of them its own
    monkeypatch.setattr(threads, "_cpu_times", lambda proc: next(times))
    monkeypatch.setattr(threads.time, "monotonic", lambda: 1.5)
    with threads.threads_for_cpu_work(torch.device("cpu")):
        pass
    assert calls == [1] and threads._last == {"ended": 1.0, "busy": 1.0}
    monkeypatch.setattr(threads, "_cpu_times", lambda proc: None)
    configured, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    with threads.threads_for_cpu_work(torch.device("cpu")):  # half a second later: the read's measure stands
        assert torch.get_num_threads() == threads.fitted_threads(configured, cores, 1.0)
    assert calls == [1]
    monkeypatch.setattr(threads.time, "monotonic", lambda: 1.0 + threads.FRESH_S + 1)
    with threads.threads_for_cpu_work(torch.device("cpu")):  # stale: measured again
        pass
    assert calls == [1, 1]

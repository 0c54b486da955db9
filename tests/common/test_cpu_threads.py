"""The threading policy: spin only on dedicated cores, respect quotas and explicit settings."""

from __future__ import annotations

from pathlib import Path

from fleetserve.common.cpu_threads import (
    ACTIVE_SPIN_COUNT,
    AUTO_MARKER,
    CpuBudget,
    apply_threading_env,
    choose_threading,
    read_cpu_budget,
)


def test_dedicated_idle_cores_spin_with_one_thread_each() -> None:
    choice = choose_threading(CpuBudget(8, None, 0.5), {})
    assert (choice.wait_policy, choice.num_threads) == ("ACTIVE", 8)
    assert "dedicated" in choice.reason


def test_a_quota_below_the_affinity_waits_passively_with_the_quota_as_threads() -> None:
    choice = choose_threading(CpuBudget(16, 2.5, 0.0), {})
    assert (choice.wait_policy, choice.num_threads) == ("PASSIVE", 2)
    assert "quota of 2.5 core(s)" in choice.reason


def test_a_loaded_machine_waits_passively() -> None:
    choice = choose_threading(CpuBudget(2, None, 9.7), {})
    assert (choice.wait_policy, choice.num_threads) == ("PASSIVE", 2)
    assert "shared" in choice.reason


def test_explicit_environment_wins() -> None:
    choice = choose_threading(CpuBudget(8, None, 0.0), {"OMP_WAIT_POLICY": "passive"})
    assert choice.wait_policy == "PASSIVE" and "set in the environment" in choice.reason
    assert choose_threading(CpuBudget(8, None, 0.0), {"OMP_NUM_THREADS": "3"}).num_threads is None


def test_cgroup_v2_and_v1_quotas_are_read(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert read_cpu_budget(tmp_path).quota_cores == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert read_cpu_budget(tmp_path).quota_cores is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert read_cpu_budget(v1).quota_cores == 2.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert read_cpu_budget(v1).quota_cores is None
    assert read_cpu_budget(tmp_path / "absent").affinity_cores >= 1


def test_spinning_is_bounded_and_marked_so_a_child_chooses_again() -> None:
    env: dict[str, str] = {}
    assert apply_threading_env(env, CpuBudget(8, None, 0.0)).wait_policy == "ACTIVE"
    assert env == {
        "OMP_WAIT_POLICY": "ACTIVE",
        "GOMP_SPINCOUNT": str(ACTIVE_SPIN_COUNT),
        AUTO_MARKER: "1",
    }
    # A child inherits env, but its machine is busy now: it waits passively, spin count dropped.
    assert apply_threading_env(env, CpuBudget(8, None, 7.0)).wait_policy == "PASSIVE"
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", AUTO_MARKER: "1"}


def test_a_users_openmp_settings_are_kept_and_not_marked() -> None:
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert apply_threading_env(env, CpuBudget(2, None, 9.0)).wait_policy == "ACTIVE"
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {"GOMP_SPINCOUNT": "0"}
    apply_threading_env(env, CpuBudget(8, None, 0.0))
    assert env == {"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "ACTIVE", AUTO_MARKER: "1"}

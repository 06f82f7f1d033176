"""A program written for nvidia-resiliency-ext's fault_tolerance API, run against ours.

Only the block between BEGIN IMPORTS and END IMPORTS differs from the same program written
for the reference (the reference's spelling of that block is the comment inside it);
tests/test_migration.py checks that no other line names ft_client or ft_monitor, and runs

    python tests/workers/reference_style_script.py WORKDIR        (WORKDIR: private, short path)

It plays the launcher and two ranks, the way the reference's own tests do:

- config: FaultToleranceConfig.from_args (a YAML file with a nested fault_tolerance
  mapping, overridden by a flag), from_yaml_file, from_kwargs, to_yaml_file;
- one RankMonitorServer.run_in_subprocess per rank; terminate() and join() at the end;
- each rank (torch.multiprocessing spawn, gloo): RankMonitorClient, init_workload_monitoring,
  load_state_dict of a checkpoint the reference wrote, sections and heartbeats,
  calculate_and_set_hb_timeouts and calculate_and_set_section_timeouts (collectives),
  state_dict, and a TimeoutsCalc of its own agreed across ranks with synchronize_all;
- then rank 1 hangs in a section; its monitor ends it with rank_termination_signal (SIGUSR1),
  which the rank turns into exit code 123, as in the reference's tests.

Each rank writes what it saw to WORKDIR/rank<N>.json; the last line printed is
"RESULT <json>" with the ranks' exit codes and the monitors' exit codes.
"""

import argparse
import json
import os
import signal
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp

# BEGIN IMPORTS. The reference version of this block:
#   from nvidia_resiliency_ext import fault_tolerance
#   from nvidia_resiliency_ext.fault_tolerance.data import FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR
#   from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts, SectionAction, SectionTimeouts
#   from nvidia_resiliency_ext.fault_tolerance.timeouts_calc import TimeoutsCalc, TimeoutsCalcError
import ft_monitor as fault_tolerance
from ft_client import HeartbeatTimeouts, SectionAction, SectionTimeouts, TimeoutsCalc, TimeoutsCalcError
from ft_client.env import FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR

# END IMPORTS

WORLD_SIZE = 2
STEPS = 6
TERM_BY_FT_EXIT_CODE = 123
CONFIG_YAML = """\
training:
  lr: 0.1
  fault_tolerance:
    initial_rank_heartbeat_timeout: 60
    rank_heartbeat_timeout: 45
    rank_section_timeouts:
      step: 60
      hang: 1.0
    rank_out_of_section_timeout: 60
    workload_check_interval: 1.0
    rank_termination_signal: SIGUSR1
    # Not the reference's (its from_kwargs ignores keys it does not know): how long the
    # monitor waits for the signalled rank to exit before SIGKILL. The default, 5 s, is less
    # than a torch process took to exit on a 2-core machine under a load of 11 (6.3 s).
    termination_grace_time: 60
"""
CHECKPOINT = {  # as the reference's RankMonitorClient.state_dict() writes it
    "current_timeouts": {
        "heartbeat": {"initial": 120.0, "subsequent": 30.0, "were_calculated": True},
        "section": {"section": {"step": 12.0, "hang": 1.0}, "out_of_section": 40.0,
                    "calculated_sections": ["step"], "is_out_of_section_calculated": True},
    }
}


def load_config(workdir):
    cfg_path = os.path.join(workdir, "ft.yaml")
    with open(cfg_path, "w") as f:
        f.write(CONFIG_YAML)
    parser = argparse.ArgumentParser()
    parser.add_argument("--ft-cfg-path", default=None)
    parser.add_argument("--ft-initial-rank-heartbeat-timeout", default=None)
    args = parser.parse_args(["--ft-cfg-path", cfg_path, "--ft-initial-rank-heartbeat-timeout", "90"])
    cfg = fault_tolerance.FaultToleranceConfig.from_args(args)
    assert cfg.initial_rank_heartbeat_timeout == 90 and cfg.rank_heartbeat_timeout == 45
    assert cfg.rank_termination_signal == signal.SIGUSR1
    from_file = fault_tolerance.FaultToleranceConfig.from_yaml_file(cfg_path)
    assert from_file.initial_rank_heartbeat_timeout == 60
    copy_path = os.path.join(workdir, "ft-copy.yaml")
    cfg.to_yaml_file(copy_path)
    assert fault_tolerance.FaultToleranceConfig.from_yaml_file(copy_path) == cfg
    kw = fault_tolerance.FaultToleranceConfig.from_kwargs(rank_heartbeat_timeout=7.5, workload_check_interval=2.0)
    assert kw.rank_heartbeat_timeout == 7.5
    return cfg


def agreed_calculator(rank):
    """The reference's distributed TimeoutsCalc example, on two ranks: only rank 1 records."""
    tc = TimeoutsCalc(sections=["one", "two"], start_time=0, safety_factor=1.0)
    if rank == 1:
        tc.update_on_section_event(section="one", action=SectionAction.OPEN, event_time=10)
        tc.update_on_section_event(section="one", action=SectionAction.CLOSE, event_time=11)
        tc.update_on_section_event(section="two", action=SectionAction.OPEN, event_time=22)
        tc.update_on_section_event(section="two", action=SectionAction.CLOSE, event_time=26)
        try:
            tc.update_on_section_event(section="two", action=SectionAction.CLOSE, event_time=27)
            raise AssertionError("closing a closed section was accepted")
        except TimeoutsCalcError:
            pass
    assert tc.can_get_section_timeouts() is (rank == 1)
    tc.synchronize_all()
    merged = tc.get_section_timeouts(current=SectionTimeouts(section={"one": 3.0, "two": 3.0}, out_of_section=3.0,
                                                              calculated_sections={"one"},
                                                              is_out_of_section_calculated=False))
    hb = TimeoutsCalc(start_time=0, safety_factor=2.0)
    for t in (10, 11, 18, 20):
        hb.update_on_heartbeat(hb_time=t)
    hb_merged = hb.get_hb_timeouts(current=HeartbeatTimeouts(21, 15, were_calculated=True))
    return {"sections": tc.get_section_timeouts().section, "out_of_section": tc.get_section_timeouts().out_of_section,
            "merged": merged.section, "merged_out_of_section": merged.out_of_section,
            "hb_merged": [hb_merged.initial, hb_merged.subsequent]}


def rank_main(rank, workdir, socket_path):
    def on_termination(*_):
        sys.exit(TERM_BY_FT_EXIT_CODE)

    signal.signal(signal.SIGUSR1, on_termination)
    os.environ["RANK"] = str(rank)
    os.environ[FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR] = socket_path
    dist.init_process_group("gloo", init_method="file://" + os.path.join(workdir, "rendezvous"),
                            rank=rank, world_size=WORLD_SIZE)
    client = fault_tolerance.RankMonitorClient()
    client.init_workload_monitoring()
    client.load_state_dict(CHECKPOINT)
    seen = {"loaded_hb": [client.hb_timeouts.initial, client.hb_timeouts.subsequent,
                          client.hb_timeouts.were_calculated],
            "loaded_step": client.section_timeouts.section["step"]}
    for _ in range(STEPS):
        client.start_section("step")
        time.sleep(0.05 * (rank + 1))  # a training step
        client.end_section("step")
        client.send_heartbeat()
    assert client.calculate_and_set_hb_timeouts()
    assert client.calculate_and_set_section_timeouts(selected_sections=["step"], calc_out_of_section=True)
    seen["hb"] = [client.hb_timeouts.initial, client.hb_timeouts.subsequent, client.hb_timeouts.were_calculated]
    seen["sections"] = dict(client.section_timeouts.section)
    seen["calculated_sections"] = sorted(client.section_timeouts.calculated_sections)
    seen["out_of_section"] = client.section_timeouts.out_of_section
    state = client.state_dict()
    client.load_state_dict(json.loads(json.dumps(state)))
    seen["calc"] = agreed_calculator(rank)
    seen["is_initialized"] = client.is_initialized
    with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    if rank == 1:
        client.start_section("hang")
        time.sleep(60)  # hung: the monitor ends this rank after 1 s
        sys.exit(1)
    client.end_all_sections()
    client.shutdown_workload_monitoring()
    try:
        client.send_heartbeat()
        raise AssertionError("a heartbeat after shutdown was accepted")
    except fault_tolerance.RankMonitorClientError:
        pass
    dist.destroy_process_group()


def main(workdir):
    cfg = load_config(workdir)
    sockets = [os.path.join(workdir, f"_rmon_r{rank}.socket") for rank in range(WORLD_SIZE)]
    monitors = [
        fault_tolerance.RankMonitorServer.run_in_subprocess(
            cfg=cfg, ipc_socket_path=sockets[rank], is_restarter_logger=False, mp_ctx=mp.get_context("spawn")
        )
        for rank in range(WORLD_SIZE)
    ]
    try:
        ctx = mp.get_context("spawn")
        ranks = [ctx.Process(target=rank_main, args=(rank, workdir, sockets[rank])) for rank in range(WORLD_SIZE)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(timeout=90)
        rank_codes = [p.exitcode for p in ranks]
    finally:
        for p in monitors:
            p.terminate()
            p.join(timeout=30)
    print("RESULT " + json.dumps({"ranks": rank_codes, "monitors": [p.exitcode for p in monitors]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

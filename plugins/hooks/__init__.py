from plugins.hooks.run_dir import RunDirHook, phase_done_marker, replay_gate_marker

__all__ = ["RunDirHook", "phase_done_marker", "replay_gate_marker"]

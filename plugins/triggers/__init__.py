from plugins.triggers.run_dir import ReplayGateTrigger, RunMarkerTrigger

__all__ = ["ReplayGateTrigger", "RunMarkerTrigger"]

from plugins.sensors.run_dir import PhaseCheckpointSensor, ReplayGateSensor

__all__ = ["PhaseCheckpointSensor", "ReplayGateSensor"]

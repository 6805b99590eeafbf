from plugins.hooks.run_dir import RunDirHook

__all__ = ["RunDirHook"]

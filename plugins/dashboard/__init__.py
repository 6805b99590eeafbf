from plugins.dashboard.app import URL_PREFIX, create_app

__all__ = ["URL_PREFIX", "create_app"]

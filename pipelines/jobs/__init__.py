"""The work of the entry points as library functions: whatever one entry point runs of another's (the main job
generates data, evaluates and cross-validates) lives here, and the entry modules (``pipelines/<name>.py`` with a
``main``) only parse their config and call it."""

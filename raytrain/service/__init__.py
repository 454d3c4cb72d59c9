"""The cluster service: whatever trains, the same placement, auth, ports, run directory, storage,
resume, preemption, progress and ``result.json``. Its public face is ``raytrain``'s top-level API."""

"""Entry points: what builds a whole server from ServerArgs. engine_factory picks and builds the
EngineClient (in-process Engine or Ray actors); ray_serve wraps the same gateway in a Ray Serve
deployment; runtime.cli (`shoal`) uses both. The only layer that knows every other one."""

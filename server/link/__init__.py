"""The worker link: how `--workers N` worker processes reach the one engine process.

The worker's side is `RemoteEngine` (remote.py, with remote_channel.py, remote_control.py,
remote_generate.py and remote_regions.py), an `engine.facade.EngineFacade`, so the front-ends run
unchanged in a worker; the engine process's side is `EngineHost` (host.py, with host_control.py,
host_generate.py and host_peer.py) in front of one `engine.engine.Engine`. They speak the frames
of frames.py over a unix socket, and tensors travel in the shared-memory arenas of shm/.
server/workers.py and server/supervisor.py start them; engine/ imports nothing from here."""

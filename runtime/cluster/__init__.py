"""The Ray runtime: the same gateway → scheduler → worker flow, spread over actors.

    gateway (aiohttp, in the driver, a GatewayActor, or a Ray Serve replica)
      └─ RayEngineClient          routes each request to a replica (RoutingPolicy; cache_aware reads the
           │                      replicas' prefix-cache events), pumps its output deltas back, health-
           │                      checks replicas, relaunches dead ones and moves their live streams
           ▼  GenerateRequest / abort in, OutputPoll frames out: msgpack over a direct TCP link per client
           │  (RequestLink ⇄ LinkServer; no Ray call per request or step)
      SchedulerActor = TP rank 0 (one per DP replica, or per DP rank with DP attention): a SchedulerHost
           │  (the Engine's own scheduler thread) over rank 0's in-process TpWorker — no RPC per step
           ▼  one msgpack WorkerBatch per step over a StepChannel: shm ring on one node, gloo across (BroadcastWorker)
      TpWorkerActor (TP ranks 1..N-1): follows each step; NCCL collectives keep the ranks' logits equal

A replica's actors sit in one placement group (a bundle per TP rank); each holds one GPU as far as
Ray's scheduler is concerned. launch.create_ray_engine_client builds all of it; runtime.entrypoints
puts the gateway in front (the CLI, a GatewayActor, or Ray Serve). Nothing here is imported by the
layers below (scheduler, worker, model); they run unchanged inside the actors."""

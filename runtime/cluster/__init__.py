"""The Ray runtime: the same gateway → scheduler → worker flow, spread over actors.

    gateway (aiohttp, in the driver, a GatewayActor, or a Ray Serve replica)
      └─ RayEngineClient          routes each request to a replica (RoutingPolicy), pumps its output
           │                      deltas back, health-checks replicas and relaunches dead ones
           ▼  GenerateRequest / AbortRequest / OutputPoll (msgspec Structs)
      SchedulerActor (one per DP replica, or per DP rank with DP attention)
           │  hosts runtime.managers.scheduler.Scheduler on a thread; WorkerGroup is its WorkerClient
           ▼  one msgpack-encoded WorkerBatch per step to every TP rank, BatchResult back from rank 0
      TpWorkerActor (one per GPU / TP rank): torch.distributed group of the replica + TpWorker

A replica's actors sit in one placement group (a bundle per TP rank). launch.create_ray_engine_client
builds all of it; runtime.entrypoints.ray_serve puts the gateway behind Ray Serve. Nothing here is imported by the layers
below (scheduler, worker, model); they run unchanged inside the actors."""

"""The PD-disaggregated cluster at run time: the scheduler process and the engine processes.

The messages they exchange live below them, in ``dualpath.protocol``; the scheduler runs the
pure policy of ``dualpath.scheduler`` unchanged. The modules:

The scheduler process
    launcher           ``LocalCluster``: the scheduler loop thread, the engines this host starts
    coordinator        ``Coordinator``: one control socket and one message table, in three parts:
    membership           engines joining, liveness (reports, process exits), sending to them
    fetches              the groups' loads and fetches, through ``scheduler.fetching``
    lifecycle            each request from submit to its last token, failures, re-placement
    group_load         one group's load as its engines last reported it, as the policy sees it
    request_state      a request as the scheduler tracks it, and the placement limit
    replacement        when a request that lost an engine is placed again
    hits               how much of a prompt the store holds (lookups only)
    persisting         blocks a DE is still writing, and the requests that wait for them
The engine processes
    engine_processes   spawn, watch, restart and stop the engines one host starts
    engine_process     one engine: joins the scheduler, handles its messages, reports, works
    roles              what it does as a PE or a DE on our engine, behind the interface of
                         ``dualpath.engine.role`` (on vLLM: ``dualpath.vllm.roles``)
"""

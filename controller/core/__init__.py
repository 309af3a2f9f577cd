"""The controller's pure decision core: what it knows of each region and the verdicts it
draws from that. No sockets, no clock reads (every call takes ``now``), no globals.

- :mod:`controller.core.region_state`: the typed region state (the region's record, its
  balancers, their latest reports).
- :mod:`controller.core.balancer_liveness`: a balancer registers, reports, refreshes,
  dies, deregisters and, unlisted and gone long enough, is forgotten.
- :mod:`controller.core.failover`: when a region is alive (in DNS, owning its replicas)
  and when it is out.
- :mod:`controller.core.drain`: when a draining replica's drain ends.
- :mod:`controller.core.recovery`: a region as a (re)started controller takes it from its
  state file.

controller/service.py drives it from its gRPC handlers, HTTP app and loops, and does the
I/O the verdicts call for (persist, push the topology, sync DNS), as the balancer's
daemon drives the routing core (skymesh/routing).
"""

"""Queue disciplines: the order in which the dispatcher offers queued requests of one
priority to the policy. The interface is :mod:`skymesh.routing.disciplines.base`; each
discipline is one file here; :mod:`skymesh.routing.queue_registry` names them."""

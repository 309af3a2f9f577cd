"""The sources a :class:`~skymesh.routing.cache_view.CacheView` asks what a replica caches,
one file each (the protocol is :class:`~skymesh.routing.cache_sources.base.CacheSource`);
the order they are consulted in is :func:`skymesh.routing.model.cache_sources`."""

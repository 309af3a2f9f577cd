"""Admission rules: what a region checks, in order, before it queues a new request. The
interface is :mod:`skymesh.routing.admission.base`; each rule is one file here;
:mod:`skymesh.routing.admission.rules` builds the ordered list from the region's settings."""

"""Generated from proto/ by `python -m skymesh.runtime.proto_build`; do not edit."""

"""Generated from proto/ by `python -m skymesh.proto_build`; do not edit."""

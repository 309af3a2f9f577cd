"""What an operator runs on a machine: `skymesh up` (the local mesh and its delay proxy),
`skymesh status`, `skymesh config`."""

"""Who may call what: the admin and peer tokens, the mesh CA and mTLS identities, and the
offline credential issuer (`skymesh pki`)."""

"""What every part of the service stands on: the error kinds and their statuses, the limits and their flags, the
bearer tokens, the per-address shares of a capacity and the ports."""

"""The mixed instance: one engine for both phases, behind the same router (the PD baseline)."""

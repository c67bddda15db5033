"""``persia-launcher``: one subcommand per role, plus ``local`` for a whole cluster."""

"""etude.serve: ``etude serve``, an OpenAI-compatible server over the engine, with tiers and a
usage ledger (see ``etude.serve.app``)."""

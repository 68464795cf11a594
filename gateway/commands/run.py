"""`delay-gateway run`: the gateway's consumers, in one virtual host or each of --vhosts, until SIGTERM."""

from gateway.settings import Settings


def main(settings: Settings) -> int:
    if settings.vhosts:
        from gateway.broker.run.vhosts import serve
        return serve(settings)
    from gateway.broker.run.worker import main as run_worker
    return run_worker(settings)

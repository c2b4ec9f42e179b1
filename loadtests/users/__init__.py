"""locust user classes, one file per transport. These modules import locust (which patches the
process with gevent): only locust's CLI loads them, never the harness. They live in a folder of
their own because locust puts a locustfile's folder on sys.path while it imports it."""

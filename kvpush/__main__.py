"""``python -m kvpush``: the same CLI as the ``kvpush`` command."""

from kvpush.cli.app import run

if __name__ == "__main__":
    run()

"""`rose demo`: an embedded Redis, a worker and a few producers in one command (see rose.cli.demo)."""

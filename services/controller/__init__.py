"""The controller: `pdserve` command line, cluster placement and lifecycle."""

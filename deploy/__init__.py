"""Deployment recipes for running qserve replicas under other people's orchestrators."""

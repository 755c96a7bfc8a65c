"""The wire: protocol constants (protocol.json), header packing, scapy layers, job config.

Imports only thc.codec (the packer); everything above reads the protocol from here.
"""

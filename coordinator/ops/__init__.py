"""The operations tools: brokers (the embedded one, a local Mosquitto), provisioning a fleet's
certificates and credentials, and spawning client processes. The runtime uses them to stand a
run up; none of them knows about rounds or strategies."""

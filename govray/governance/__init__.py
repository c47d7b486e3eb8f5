"""What governs a gradient: provenance credentials, canaries, memorization measures, the signed
depth policy, the routing table it resolves to, adapters, and the masked (governance-aware) allreduce."""

{
  "payload": "eyJfdHlwZSI6Imh0dHBzOi8vZ292cmF5LmRldi9Qb2xpY3lTaWduYXR1cmUvdjEiLCJwb2xpY3lfbmFtZSI6ImRpZ2l0cyIsInBvbGljeV9zaGEyNTYiOiJlNTczYzFlM2Y3ZjZlYTk3NjZiZTEwNzBkYWVjNGFkNTMwMDYyNDFjODdiYjFmZmY3ZDhkZTI0N2E5MmVkZjI4IiwicG9saWN5X3ZlcnNpb24iOjEsInNpZ25lZF9hdCI6IjIwMjYtMTEtMjFUMjE6NTI6MzVaIn0=",
  "payloadType": "application/vnd.govray.policy-signature+json",
  "signatures": [
    {
      "keyid": "38ecce21b7ba4dea9663d040749330a6f8c7b2954ada6e0294ccc117d1b9bddb",
      "sig": "toMz4mOfEkZrxNt8rmhA6S25OWmdZTRqZq4fxoxkXvbl6THnaU1FiuOAo82PxRtReX5IriCJp0SYsBfCpB0cBQ=="
    }
  ]
}

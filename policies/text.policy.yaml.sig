{
  "payload": "eyJfdHlwZSI6Imh0dHBzOi8vZ292cmF5LmRldi9Qb2xpY3lTaWduYXR1cmUvdjEiLCJwb2xpY3lfbmFtZSI6InRleHQiLCJwb2xpY3lfc2hhMjU2IjoiMDM3ODM5ZDk2M2RhNWFjOWUxM2Q0ZDBlODdkYTU3Yzc4OThiNmYyZTViMWNlNTBkZGE2MTExMTMzOTQ5ZTA2OCIsInBvbGljeV92ZXJzaW9uIjoxLCJzaWduZWRfYXQiOiIyMDI2LTExLTIyVDAwOjE4OjU0WiJ9",
  "payloadType": "application/vnd.govray.policy-signature+json",
  "signatures": [
    {
      "keyid": "14a581a2fbdf4fcd7564bcf84e4250c689a67abb248e67d8de894c97935defdb",
      "sig": "7oASTUCWbz1qtnyR5ySJxSE157ivutcHRJYh5MI2Xw8IlVUzdHAIHPRUfJERBVmw0KxKSvOuLjU/ROCW4AQLDQ=="
    }
  ]
}

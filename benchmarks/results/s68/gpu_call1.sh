#!/usr/bin/env bash
# Session 68, device calls 1-2 (as session 67) (H200): the SmolLM2 GGUF travels in three parts (split -n 3 -d -a 2;
# md5 a1231443440b107ff29f02bdb38c9d0a whole); call N copies part_0(N-1) to /root/smol.
mkdir -p /root/smol && cp .devcarry/gg/part_0$1 /root/smol/ && ls -la /root/smol && nvidia-smi -L

#!/usr/bin/env bash
# Remake docs/screenshots/: the real viewer window on an X server (Xvfb, Qt's xcb
# plugin) for each bundled sample and two real snapshots recorded elsewhere.
# Needs Xvfb and the viewer's system libraries (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
command -v xvfb-run >/dev/null || { echo "screenshots: needs xvfb-run (apt-get install xvfb xauth)" >&2; exit 2; }
out=docs/screenshots
shot() {  # NAME FILE [KIND [GROUP] | --allocator SETTINGS]: KIND selects the first finding of that kind, GROUP groups the table
  local name=$1 file=$2 select=() group=()
  [ -n "${3:-}" ] && select=(--select "$3")
  [ -n "${4:-}" ] && group=(--group "$4")
  [ "${3:-}" = "--allocator" ] && select=(--allocator "$4") && group=()
  xvfb-run -a -s "-screen 0 1600x1000x24" env -u QT_QPA_PLATFORM TRACEKIT_SETTINGS="$(mktemp -u).ini" \
    .venv/bin/python -m tracekit_gui --screenshot "$out/$name.png" "${select[@]}" "${group[@]}" -- "$file"
  echo "$out/$name.png"
}
shot gpt_adamw samples/gpt_adamw.pickle
shot leak_loop_leak_selected samples/leak_loop.pickle leak
shot logits_spike_spike_selected samples/logits_spike.pickle spike
shot real_snapshot_peak tests/fixtures/real/snapshot_newest_format_windows_paths.pickle peak
shot real_cpp_frames_adamw_full_step tests/fixtures/real/snapshot_cpp_frames_adamw_full_step.pickle
shot real_legacy_snapshot_no_timeline tests/fixtures/real/snapshot_legacy_torch20_oom_observer.pickle
shot allocator_opt_expandable tests/fixtures/cuda/opt_amp_adamw_b4_s256.pickle.gz --allocator expandable_segments:True
# Hugging Face models recorded with torch's own API (issue 22): no torch-recorded GPT-2 file is bundled, so Qwen2
shot hf_qwen2_training_by_library_line tests/fixtures/cuda/qwen2_amp_adamw_b4_s256.pickle.gz "" library
shot hf_qwen2_generation_by_module tests/fixtures/cuda/qwen2_generate_b2_p256_n128.pickle.gz "" module

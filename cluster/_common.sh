# Shared by cluster/start_head.sh and cluster/start_workers.sh (sourced, not run).

# print a command the way a shell would read it back
show() {
  local out="" arg
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+="$arg "; else out+="'${arg//\'/\'\\\'\'}' "; fi
  done
  echo "+ ${out% }"
}

# show a command, and run it unless DRY_RUN=1
run() {
  show "$@"
  if [[ ${DRY_RUN:-0} -eq 0 ]]; then "$@"; fi
}

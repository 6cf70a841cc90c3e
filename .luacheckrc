-- luacheck's settings for the Redis scripts (datagen/control/lua, workers/claim/lua); scripts/check runs
-- `luacheck` over every .lua file, from the repository's root.
std = "lua51"
-- What Redis gives a script.
read_globals = {"redis", "KEYS", "ARGV", "cjson", "cmsgpack", "bit", "struct", "unpack"}
max_line_length = 110

-- The library's functions: the loader puts lib.lua before a script that starts `--! uses lib`, so
-- a script sees them as globals it cannot change.
local lib = {
  "job_read", "counted", "job_set", "job_write", "decimal", "job_incarnation", "counts_in", "leave_running", "partition_label",
  "breakdown_field", "tally", "add_counts", "count_and_complete", "finish_in_rq", "ack_in_job", "weight_units",
  "rejoin", "save_queued", "backlog_push", "leave", "count_cancelled_queued", "label_field", "label_fields",
  "labels_read",
}

-- A script's arguments: the loader (datagen/control/scripts.py, `source`) binds each name its signature
-- gives a KEYS[i] or ARGV[i] (the comment the file opens with) to a local before the script, so the
-- script sees those names as globals it cannot change too. Read here from the same signature.
local function arguments(path)
  local names = {}
  for line in io.lines(path) do
    if line:sub(1, 2) ~= "--" then break end
    local name = line:match("^%-%-%s+KEYS%[%d+%.?%.?%]%s+([%w_]+)")
      or line:match("^%-%-%s+ARGV%[%d+%.?%.?%]%s+([%w_]+)")
    if name then names[#names + 1] = name end
  end
  return names
end

local lfs = require "lfs"
for _, folder in ipairs({"datagen/control/lua", "workers/claim/lua"}) do
  for file in lfs.dir(folder) do
    if file:match("%.lua$") and file ~= "lib.lua" then
      local path = folder .. "/" .. file
      local names = arguments(path)
      for _, name in ipairs(lib) do names[#names + 1] = name end
      files[path] = {read_globals = names}
    end
  end
end
-- In the library itself each function is used by the scripts, not by the library.
files["datagen/control/lua/lib.lua"] = {ignore = {"211"}}

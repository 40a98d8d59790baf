{{/*
Names, labels, the stage table and the pieces every pod shares.
*/}}

{{/* Release-qualified base name, short enough that "<name>-prefill" and the like fit 63. */}}
{{- define "epd.fullname" -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if hasPrefix $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select one component's pods: (dict "root" $ "component" "api"). */}}
{{- define "epd.selectorLabels" -}}
app.kubernetes.io/name: {{ default .root.Chart.Name .root.Values.nameOverride }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Every object's labels: the selector labels and the chart's. */}}
{{- define "epd.labels" -}}
{{ include "epd.selectorLabels" . }}
app.kubernetes.io/part-of: epd-pipeline
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "epd.image" -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end -}}

{{/*
The topics each stage's consumer group reads, by stage (the readers column of CHANNELS in
schemas/topics.py; tests/unit/test_helm_chart.py holds the two equal). The group of a stage is
"{prefix}-{stage}" and a topic "{prefix}.{name}" (Topics.group and Topics.topic).
*/}}
{{- define "epd.stageTopics" -}}
router: [render]
encode: [encode]
prefill: [prefill]
decode: [decode]
results: [encoded, results]
{{- end -}}

{{/* The worker stages in the order they are rendered (the keys of epd.stageTopics). */}}
{{- define "epd.stages" -}}
[router, encode, prefill, decode, results]
{{- end -}}

{{/*
Refuse to render without the secrets a running pipeline needs: never a default secret. The
length floor is MIN_SECRET_CHARS of runtime/settings.py, which the processes enforce as well.
*/}}
{{- define "epd.checkSecrets" -}}
{{- if not .Values.secrets.existingSecret -}}
{{- $secret := required "secrets.ecSecret is required (EPD_EC_SECRET, shared by every process): pass --set secrets.ecSecret=$(openssl rand -hex 32), or name a Secret of your own with secrets.existingSecret" .Values.secrets.ecSecret -}}
{{- if lt (len $secret) 16 -}}
{{- fail (printf "secrets.ecSecret has %d characters, fewer than 16: use a random value, e.g. $(openssl rand -hex 32)" (len $secret)) -}}
{{- end -}}
{{- if and (not .Values.secrets.apiTokens) (not .Values.api.allowOpen) -}}
{{- fail "secrets.apiTokens is required (EPD_API_TOKENS, TOKEN=TENANT,...): set it, name a Secret with secrets.existingSecret, or set api.allowOpen=true to serve an open API" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "epd.secretName" -}}
{{- default (include "epd.fullname" .) .Values.secrets.existingSecret -}}
{{- end -}}

{{/*
The EPD_* settings every process reads, as a map: the chart-owned ones from their values, then
values.settings. EPD_PIXEL_DTYPE defaults to bf16 when the encode stage runs on a GPU (the
fan-out casts encoder inputs before they travel) and fp32 otherwise (exact CPU parity).
*/}}
{{- define "epd.settings" -}}
{{- $out := dict -}}
{{- $_ := set $out "EPD_PIXEL_DTYPE" (ternary "bf16" "fp32" (gt (int .Values.workers.encode.gpus) 0)) -}}
{{- range $k, $v := .Values.settings -}}
{{- $_ := set $out $k (toString $v) -}}
{{- end -}}
{{- $_ := set $out "EPD_KAFKA_BOOTSTRAP" .Values.kafka.bootstrapServers -}}
{{- $_ := set $out "EPD_TOPIC_PREFIX" .Values.kafka.topicPrefix -}}
{{- $_ := set $out "EPD_REDIS_URL" .Values.redis.url -}}
{{- $_ := set $out "EPD_DECODE_STAGE" (toString .Values.workers.decode.enabled) -}}
{{- if not (hasKey .Values.settings "EPD_READY_STAGES") -}}
{{- /* /readyz waits for a live worker of each stage that always runs one: a stage KEDA may
scale to zero is left out, or the API would take no traffic and no lag would wake it. */ -}}
{{- $ready := list -}}
{{- range $stage := list "encode" "prefill" "results" "decode" -}}
{{- $w := index $.Values.workers $stage -}}
{{- $least := ternary $w.keda.minReplicas $w.replicas $.Values.keda.enabled -}}
{{- if and $w.enabled (ge (int $least) 1) -}}
{{- $ready = append $ready $stage -}}
{{- end -}}
{{- end -}}
{{- $_ := set $out "EPD_READY_STAGES" (join "," $ready) -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The secret-backed env of a pod: (dict "root" $ "api" true) adds the API tokens. */}}
{{- define "epd.secretEnv" -}}
{{- $v := .root.Values -}}
- name: EPD_EC_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "epd.secretName" .root }}
      key: {{ $v.secrets.ecSecretKey }}
{{- if and .api (or $v.secrets.existingSecret $v.secrets.apiTokens) }}
- name: EPD_API_TOKENS
  valueFrom:
    secretKeyRef:
      name: {{ include "epd.secretName" .root }}
      key: {{ $v.secrets.apiTokensKey }}
      {{- /* Only an open API may run without the key; otherwise a missing key stops the pod. */}}
      optional: {{ $v.api.allowOpen }}
{{- end }}
{{- end -}}

{{/* Pod annotations that roll the pods when the settings or the chart-made Secret change. */}}
{{- define "epd.checksums" -}}
checksum/settings: {{ include "epd.settings" . | sha256sum }}
checksum/secret: {{ printf "%s|%s|%s" .Values.secrets.existingSecret .Values.secrets.ecSecret .Values.secrets.apiTokens | sha256sum }}
{{- end -}}

{{/* Writable scratch for a read-only root filesystem: /tmp (the heartbeat) and the cache. */}}
{{- define "epd.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- end -}}

{{- define "epd.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/epd/.cache
{{- end -}}
